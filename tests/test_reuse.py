"""Memory planning simulates identical repeated blocks once (memory/reuse.py): the
composed step equals the whole simulation
(`--no-reuse`) in every figure the report gives, and blocks that differ, or a
model that cannot run truncated, are simulated whole with a note."""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from tpplan import load_plan
from tpplan.cli.app import app
from tpplan.models import llama, mlp
from tpplan.runtime.dryrun import dry_run
from tpplan.runtime.options import ApplyOptions
from tpplan.memory.reuse import BlockReuse, find_run
from tpplan.simulation.training import TrainOptions

PLANS = Path(__file__).resolve().parent.parent / "plans"

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def llama6() -> nn.Module:
    return llama.Transformer(llama.LlamaConfig(n_layers=6))


def llama12() -> nn.Module:
    return llama.Transformer(llama.LlamaConfig(n_layers=12))


def mlp8() -> nn.Module:
    return mlp.MLP(n_blocks=8)


def hf_llama6() -> nn.Module:
    from tpplan.models.hf import _build

    return _build("LlamaConfig", "LlamaForCausalLM", "sdpa", num_hidden_layers=6)


class Indexed(mlp.MLP):
    """Runs its blocks by position: a copy with fewer blocks (kept under their own names) cannot run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)
        return x


def indexed8() -> nn.Module:
    return Indexed(n_blocks=8)


def both(plan: Path | str, model: str, tp: int = 2, **train) -> tuple[dict, dict]:
    """The JSON report with reuse and with --no-reuse (copies: tests share the runs)."""
    return json.loads(_both(str(plan), model, tp, json.dumps(train)))


@functools.cache
def _both(plan: str, model: str, tp: int, train: str) -> str:
    found = []
    for reuse in (True, False):
        report = dry_run(ApplyOptions(plan=plan, model=model, tp=tp, train=TrainOptions(**json.loads(train)), reuse_blocks=reuse))
        assert report.ok, report.problems
        found.append(report.to_json())
    return json.dumps(found)


def without_reuse_fields(report: dict) -> dict:
    stripped = json.loads(json.dumps(report))
    del stripped["memory"]["block_reuse"], stripped["notes"]
    for rank in stripped.get("ranks", ()):  # each simulated position's memory names it too
        del rank["memory"]["block_reuse"]
    return stripped


MEDIUM = ("llama_tp_sp.yaml", "test_reuse:llama12", 4, dict(fsdp=2, batch=2, seq=32, dtype="bf16"))


@pytest.mark.parametrize("plan, model, tp, train", [
    ("llama_tp.yaml", "test_reuse:llama6", 2, dict(optimizer="adamw")),
    MEDIUM,
    ("mlp_tp.yaml", "test_reuse:mlp8", 2, dict(optimizer="sgd", fsdp=2)),
    # transformers' build is the slowest part: in the slow suite (pytest -m slow)
    pytest.param("hf/llama_tp.yaml", "test_reuse:hf_llama6", 2, dict(batch=2, seq=16), marks=pytest.mark.slow),
])
def test_reused_blocks_plan_exactly_the_step_of_the_whole_simulation(plan, model, tp, train):
    reused, whole = both(PLANS / plan, model, tp, **train)
    assert reused["memory"]["block_reuse"] is not None and whole["memory"]["block_reuse"] is None
    # every figure: peak and its categories, peak module, what stays, collectives and their bytes, modules, parameters
    assert without_reuse_fields(reused) == without_reuse_fields(whole)


def test_the_report_names_the_blocks_reused_and_those_simulated():
    plan, model, tp, train = MEDIUM
    reused, _ = both(PLANS / plan, model, tp, **train)
    assert reused["memory"]["block_reuse"] == {
        "container": "layers",
        "blocks": 12,
        "from": "layers.1",
        "reused": [f"layers.{i}" for i in range(2, 11)],
        "simulated": ["layers.0", "layers.1", "layers.11"],
    }
    assert len(reused["parameters"]) == 3 + 9 * 12 and "layers.7.attention.wq.weight" in reused["parameters"]


def test_a_block_under_another_rule_is_simulated_and_the_run_around_it_reused(tmp_path):
    plan = tmp_path / "last_differs.yaml"
    plan.write_text((PLANS / "mlp_tp.yaml").read_text().replace("blocks.*", "blocks.{0,1,2,3,4,5,6}"))  # blocks.7 whole
    reused, whole = both(plan, "test_reuse:mlp8", optimizer="adamw")
    found = reused["memory"]["block_reuse"]
    assert (found["from"], found["reused"], found["simulated"]) == ("blocks.1", [f"blocks.{i}" for i in range(2, 6)], ["blocks.0", "blocks.1", "blocks.6", "blocks.7"])
    assert without_reuse_fields(reused) == without_reuse_fields(whole)


def test_blocks_that_differ_every_other_one_are_simulated_whole_with_the_first_difference(tmp_path):
    plan = tmp_path / "alternating.yaml"
    plan.write_text((PLANS / "mlp_tp.yaml").read_text().replace("blocks.*", "blocks.{0,2,4,6}"))  # the odd blocks whole
    reused, whole = both(plan, "test_reuse:mlp8", optimizer="adamw")
    assert reused["memory"]["block_reuse"] is None
    assert reused["notes"] == ["no 6 consecutive blocks of 'blocks' are identical ('blocks.1' differs from 'blocks.0' "
                               "in the rule of 'in_proj'): all 8 simulated"]
    assert without_reuse_fields(reused) == without_reuse_fields(whole)


def test_a_model_that_cannot_run_truncated_is_simulated_whole_with_a_note():
    reused, whole = both(PLANS / "mlp_tp.yaml", "test_reuse:indexed8", optimizer="adamw")
    assert reused["memory"]["block_reuse"] is None
    assert len(reused["notes"]) == 1 and reused["notes"][0].startswith(
        "the model truncated to fewer blocks of 'blocks' could not be simulated (")
    assert reused["notes"][0].endswith("): all 8 blocks of 'blocks' simulated")
    assert without_reuse_fields(reused) == without_reuse_fields(whole)


def test_the_block_index_attribute_does_not_make_blocks_differ_but_other_attributes_do():
    plan = load_plan(str(PLANS / "mlp_tp.yaml"))
    model = mlp.MLP(n_blocks=6)
    for i, block in enumerate(model.blocks):
        block.layer_idx, block.width = i, 3  # layer_idx: each block's own index, as transformers' layers
    found = find_run(model, plan)
    assert (found.start, found.stop, found.template) == (0, 6, "blocks.1")
    model.blocks[3].width = 4
    assert find_run(model, plan) == ("no 6 consecutive blocks of 'blocks' are identical ('blocks.3' differs from "
                                     "'blocks.2' in the attribute width of '<block>'): all 6 simulated")


class _Func(nn.Module):  # a function as a module, as the kernels package makes one
    def forward(self, x):
        return x * torch.sigmoid(x)


def test_each_blocks_own_copy_of_a_function_module_does_not_make_blocks_differ_but_another_module_does():
    # the kernels package's use_kernelized_func (transformers 5.25): every attention holds its own copy of
    # the global function module in `_kernel_funcs`; compared by identity, every block differed from the last
    plan = load_plan(str(PLANS / "mlp_tp.yaml"))
    model = mlp.MLP(n_blocks=6)
    for block in model.blocks:
        block.__dict__["_kernel_funcs"] = {"silu": _Func()}
    found = find_run(model, plan)
    assert (found.start, found.stop) == (0, 6)
    model.blocks[4]._kernel_funcs["silu"] = nn.SiLU()  # another module: another computation
    assert find_run(model, plan) == ("no 6 consecutive blocks of 'blocks' are identical ('blocks.4' differs from "
                                     "'blocks.3' in the attribute _kernel_funcs of '<block>'): all 6 simulated")


def test_a_transformers_models_layers_are_reused():
    pytest.importorskip("transformers")
    found = find_run(hf_llama6(), load_plan(str(PLANS / "hf" / "llama_tp.yaml")))
    assert (found.container, found.start, found.stop) == ("model.layers", 0, 6)


def test_blocks_sharing_a_module_are_not_reused():
    plan = load_plan(str(PLANS / "mlp_tp.yaml"))
    model = mlp.MLP(n_blocks=6)
    for block in model.blocks[1:]:
        block.out_proj = model.blocks[0].out_proj  # one Linear in every block: reusing it would count it 6 times
    assert find_run(model, plan) == ("no 6 consecutive blocks of 'blocks' are identical ('blocks.1' differs from "
                                     "'blocks.0' in the sharing of 'out_proj'): all 6 simulated")


def test_a_per_position_setting_that_a_shorter_list_would_move_keeps_every_block():
    plan = load_plan(str(PLANS / "mlp_tp.yaml"))
    model = mlp.MLP(n_blocks=8)
    model.config = types.SimpleNamespace(layer_types=["full"] * 8)  # as transformers' config, read by enumerate(self.layers)
    assert isinstance(find_run(model, plan), BlockReuse)
    model.config.layer_types = ["full"] * 6 + ["sliding"] * 2  # blocks.7 would read position 2's "full"
    assert find_run(model, plan) == ("'config.layer_types' gives the blocks of 'blocks' settings by position that "
                                     "a shorter list would move: all 8 simulated")


def test_no_reuse_on_the_command_line_simulates_every_block_and_the_text_names_the_reused_ones():
    common = ["apply", "--dry-run", "--tp", "2", "--model", "test_reuse:mlp8", "--plan", str(PLANS / "mlp_tp.yaml"), "--optimizer", "sgd"]
    runner = CliRunner()
    whole = runner.invoke(app, [*common, "--no-reuse", "--format", "json"])
    assert whole.exit_code == 0, whole.output
    assert json.loads(whole.output)["memory"]["block_reuse"] is None
    text = runner.invoke(app, common, env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    assert "blocks: blocks.2-6 reused from blocks.1 (3 of 8 blocks of 'blocks' simulated); --no-reuse simulates them all" in text.output
