"""A version 2 plan's `training` section is the step `apply --dry-run` plans (SPEC §7):
with no flags the dry run plans exactly the step of the same plan without the section
given the equivalent flags (--batch = global_batch / (dp_replicate·dp_shard), --seq,
--dtype, --optimizer); each flag overrides its field; a pipeline's microbatches come
from the section's global batch; a global batch that does not divide is TP123 at
training.global_batch (exit 1), never a traceback."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan.cli.app import app

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

PLANS = Path(__file__).resolve().parents[1] / "plans"
TINY = "tpplan.models.llama:tiny"


def _plan(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def world_plan(tmp_path: Path, training: str = "", name: str = "plan.yaml") -> Path:
    """dp_shard 2 × tp 2 (world 4), FSDP2 on the blocks."""
    return _plan(tmp_path, name, f"""\
        version: 2
        extends: {PLANS / "llama_tp_sp.yaml"}
        rules: {{}}
        mesh: {{dp_shard: 2, tp: 2}}
        fsdp:
          units: [layers.*]
        """ + training)


SECTION = "training: {global_batch: 8, seq: 32, dtype: bf16, optimizer: sgd}\n"


def dry_run(*args: str, code: int = 0) -> dict:
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--format", "json", "--model", TINY, *args])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def figures(report: dict) -> dict:
    """The memory plan: the peak and its categories, batch, seq, dtype, optimizer_name."""
    return report["memory"]


def test_the_section_plans_the_step_the_equivalent_flags_plan(tmp_path):
    planned = dry_run("--plan", str(world_plan(tmp_path, SECTION)))
    flags = dry_run("--plan", str(world_plan(tmp_path, name="bare.yaml")), "--batch", "4", "--seq", "32", "--dtype", "bf16",
                    "--optimizer", "sgd")
    assert figures(planned) == figures(flags)
    memory = planned["memory"]
    assert (memory["batch"], memory["seq"], memory["dtype"], memory["optimizer_name"]) == (4, 32, "bfloat16", "sgd")
    assert memory["optimizer"] == 0  # sgd without momentum keeps no state
    assert planned["mesh"] == flags["mesh"] == {"dp_shard": 2, "tp": 2}
    assert planned["comm_bytes"] == flags["comm_bytes"]
    assert ("training: global_batch 8 over dp 2 → batch 4 per rank, seq 32, dtype bf16, optimizer sgd (from the plan's "
            "training section; --batch, --seq, --dtype, --optimizer override it)") in planned["notes"]
    assert not any(note.startswith("training:") for note in flags["notes"])


def test_each_flag_overrides_its_field_of_the_section(tmp_path):
    plan = world_plan(tmp_path, SECTION)
    overridden = dry_run("--plan", str(plan), "--batch", "2", "--seq", "16", "--optimizer", "adamw")
    flags = dry_run("--plan", str(world_plan(tmp_path, name="bare.yaml")), "--batch", "2", "--seq", "16", "--dtype", "bf16",
                    "--optimizer", "adamw")
    assert figures(overridden) == figures(flags)
    assert overridden["memory"]["optimizer_name"] == "adamw" and overridden["memory"]["optimizer"] > 0  # its moments
    assert ("training: dtype bf16 (from the plan's training section; --batch, --seq, --dtype, --optimizer override it)"
            in overridden["notes"])


def test_a_pipelines_microbatches_come_from_the_sections_global_batch(tmp_path):
    body = """\
        version: 2
        mesh: {pp: 2, dp_shard: 1, tp: 1}
        rules: {}
        pipeline:
          layers_per_stage: 1
          schedule: 1F1B
          microbatches: 4
        """
    planned = dry_run("--plan", str(_plan(tmp_path, "pp.yaml", body + "training: {global_batch: 8, seq: 16}\n")))
    flags = dry_run("--plan", str(_plan(tmp_path, "bare.yaml", body)), "--batch", "8", "--seq", "16")
    assert (planned["pipeline"]["microbatches"], planned["memory"]["batch"]) == (4, 2)  # 8 sequences in 4 microbatches of 2
    assert planned["pipeline"] == flags["pipeline"]  # the same step, to the byte
    mine, theirs = figures(planned), figures(flags)
    for key in ("per_rank_peak_bytes", "parameters", "gradients", "optimizer", "activations", "temporaries"):
        assert mine[key] == theirs[key], key
    assert all(mine[key] == theirs[key] for key in ("batch", "seq", "dtype", "optimizer_name", "tp", "dp"))


def test_a_global_batch_that_does_not_divide_is_tp123_at_its_key(tmp_path):
    plan = world_plan(tmp_path, "training: {global_batch: 7}\n")
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--plan", str(plan), "--model", TINY])
    assert result.exit_code == 1, result.output
    assert f"{plan}:7:26: TP123 training.global_batch: 7 sequences do not split evenly" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_with_the_rest_axis_the_per_rank_batch_is_split_over_the_resolved_mesh(tmp_path):
    plan = _plan(tmp_path, "rest.yaml", f"""\
        version: 2
        extends: {PLANS / "llama_tp_sp.yaml"}
        rules: {{}}
        mesh: {{dp_shard: -1, tp: 2}}
        training: {{global_batch: 8}}
        """)
    planned = dry_run("--plan", str(plan), "--world", "8")
    assert planned["mesh"] == {"dp_shard": 4, "tp": 2} and planned["memory"]["batch"] == 2
    bad = CliRunner().invoke(app, ["apply", "--dry-run", "--plan", str(plan), "--model", TINY, "--world", "6"])
    assert bad.exit_code == 1 and "TP123 training.global_batch: 8 sequences do not split evenly" in " ".join(bad.output.split())


def test_a_cp_plans_section_sizes_the_one_rank_dry_run_and_its_dtype_asks_for_the_worlds_memory(tmp_path):
    body = f"""\
        version: 2
        extends: {PLANS / "llama_tp.yaml"}
        rules: {{}}
        mesh: {{dp_shard: 2, cp: 2, tp: 1}}
        context_parallel:
          modules: layers.*.attention
        """
    ring = dry_run("--plan", str(_plan(tmp_path, "cp.yaml", body + "training: {global_batch: 4, seq: 16}\n")))
    flags = dry_run("--plan", str(_plan(tmp_path, "bare.yaml", body)), "--batch", "2", "--seq", "16")
    assert ring["context_parallel"] == flags["context_parallel"] and "memory" not in ring  # one CUDA rank, not memory planning
    assert ring["context_parallel"]["tokens"] == [2, 8]
    planned = dry_run("--plan", str(_plan(tmp_path, "cp_dtype.yaml", body + "training: {global_batch: 4, seq: 16, dtype: fp32}\n")))
    assert planned["memory"]["batch"] == 2 and planned["memory"]["seq"] == 16 and "cp" in planned["comms_by_axis"]
