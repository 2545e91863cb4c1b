"""The dry run's per-rank peak against `measure_training_step` on real gloo ranks
(tests/fsdp_memory_worker.py) where the collective backend's own buffers would
differ: gloo's reduce-scatter clones its whole input (FSDP2's gradient reduction),
which NCCL does not and the fake process group cannot; the measurement leaves the
backend's buffers out (memory.py's `_backend_buffers_untracked`), so both count
what the step itself allocates."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from typer.testing import CliRunner

from tpplan.cli.app import app

from test_torchrun import torchrun

TESTS = Path(__file__).resolve().parent
PLANS = TESTS.parent / "plans"
MODEL = "fsdp_memory_worker:vocab_heavy"


def test_fsdp2_with_activation_checkpointing_at_tp_1_plans_the_peak_gloo_ranks_measure(tmp_path):
    """Checkpointed blocks keep the activations low, so the peak is the root unit's
    gradient reduction at the end of backward: there gloo's clone of the reduce-scatter
    input (every unsharded gradient of the embedding and the head) used to be counted
    on the real ranks only."""
    path = tmp_path / "plan.yaml"
    path.write_text(textwrap.dedent(f"""\
        version: 2
        extends: {PLANS / 'llama_tp.yaml'}
        rules: {{}}
        mesh: {{dp_shard: 2, tp: 1}}
        fsdp: {{units: [layers.*]}}
        checkpointing: {{modules: layers.*}}
        """))
    dry = CliRunner().invoke(app, ["apply", "--dry-run", "--format", "json", "--plan", str(path), "--model", MODEL,
                                   "--world", "2", "--batch", "1", "--seq", "32"])
    assert dry.exit_code == 0, dry.output
    predicted = json.loads(dry.stdout)["memory"]
    result = torchrun(2, str(TESTS / "fsdp_memory_worker.py"), str(path), MODEL, "1", "32", pythonpath=TESTS, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(result.stdout.strip().splitlines()[-1])
    measured = max(rank["peak"] for rank in ranks)
    # gloo's clone counted: 20% over the plan. Now equal, but for the real run's timing: in about one run
    # in fifteen a rank counts one block's parameter bytes (0.9% here) more where backward starts.
    assert abs(measured / predicted["per_rank_peak_bytes"] - 1) < 0.02, (
        predicted["per_rank_peak_bytes"], measured, predicted["peak_module"], [rank["peak_module"] for rank in ranks])
