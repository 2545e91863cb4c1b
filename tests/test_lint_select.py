"""The lint's explicit state and selection: --select / --ignore (library and CLI),
TP330 saying when it cannot run, the trace cache keyed by the model's state,
the collector paused only around the trace and the flow, and the style table
that compile, the flow and the rules read."""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
from lint_helpers import meta_model
from typer.testing import CliRunner

from tpplan import load_plan
from tpplan.cli.app import app
from tpplan.core.placements import parse_placement
from tpplan.core.schema import MODULE_KINDS, STYLE_SPECS, StyleSemantics
from tpplan.lint.checks import UnknownRuleError, check_model, selected_codes
from tpplan.lint.context import LintContext, TraceCache
from tpplan.lint.rules import RULES

LLAMA = "tpplan.models.llama:tiny"
PLAN = textwrap.dedent("""\
    version: 1
    rules:
      tok_embeddings: rowwise
      layers.*.attention.w{q,k,v}: colwise
      layers.*.attention.wo: rowwise
""")


def problems(select=None, ignore=None, text=PLAN, model=LLAMA):
    plan = load_plan(text=text, file="plan.yaml")
    return [(p.code, p.severity, p.line, p.column) for p in check_model(plan, meta_model(model), [2], select=select, ignore=ignore)]


def test_without_selection_every_rule_runs():
    assert problems() == [
        ("TP320", "error", 3, 3),
        ("TP340", "warning", 4, 3),
        ("TP360", "warning", 2, 1),
    ]


def test_select_by_code_prefix_and_name_and_ignore():
    assert problems(select=["TP320"]) == [("TP320", "error", 3, 3)]
    assert problems(select=["shared-input-comms,coverage"]) == [("TP340", "warning", 4, 3), ("TP360", "warning", 2, 1)]
    # with TP320 left out, the dry run (which runs only after an error-free lint) finds the
    # shard(-1) embedding output where the attention trips on it
    assert problems(select=["TP3"], ignore=["TP36", "layout-mismatch"]) == [("TP340", "warning", 4, 3), ("TP330", "error", 4, 3)]
    assert problems(ignore=["TP320", "TP340"]) == [("TP360", "warning", 2, 1), ("TP330", "error", 4, 3)]
    assert problems(ignore=["TP3"]) == []
    assert problems(select=[]) == []


def test_selection_does_not_hide_resolution_errors():
    text = PLAN + "  nothing.matches.this: colwise\n"
    assert problems(select=["TP340"], text=text) == [("TP200", "error", 6, 3), ("TP340", "warning", 4, 3)]


def test_an_unknown_entry_is_named_with_the_closest_rules():
    with pytest.raises(UnknownRuleError) as info:
        selected_codes(["TP311", "head-divisibilty"])
    assert info.value.entry == "head-divisibilty"
    assert info.value.suggestions[0] == "head-divisibility"
    with pytest.raises(UnknownRuleError, match="'TP101' is not a lint rule"):
        selected_codes(None, ["TP101"])  # plan-format codes are not lint rules
    assert selected_codes(["tp31"]) == {"TP310", "TP311"}
    assert selected_codes(None, None) is None


def run(*args):
    return CliRunner().invoke(app, list(args), env={"FORCE_COLOR": None, "NO_COLOR": None})


def test_validate_select_and_ignore(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    result = run("validate", str(plan), "--model", LLAMA, "--tp", "2", "--format", "json", "--select", "TP32,TP340", "--ignore", "layout-mismatch")
    assert result.exit_code == 0, result.output
    assert '"TP340"' in result.stdout and '"TP320"' not in result.stdout and '"TP360"' not in result.stdout
    result = run("validate", str(plan), "--model", LLAMA, "--tp", "2", "--select", "layout-mismatch")
    assert result.exit_code == 1 and "TP320" in result.stdout and "TP340" not in result.stdout


def test_validate_rejects_an_unknown_code_with_exit_2(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    result = run("validate", str(plan), "--model", LLAMA, "--select", "TP3200")
    assert result.exit_code == 2
    assert "--select: 'TP3200' is not a lint rule" in result.output and "did you mean TP320" in result.output
    result = run("validate", str(plan), "--ignore", "style-modul")
    assert result.exit_code == 2 and "--ignore: 'style-modul'" in result.output and "style-module" in result.output


# -- TP330 says when it cannot run -----------------------------------------------------------------


def test_the_dry_run_says_it_was_skipped_when_the_forward_cannot_run():
    found = [p for p in check_model(load_plan(text="version: 1\nrules:\n  proj: colwise\n", file="plan.yaml"),
                                    meta_model("tpplan.models.rule_examples:conv_first"), [2], select=["TP330"])]
    assert [(p.code, p.severity, p.line, p.column) for p in found] == [("TP330", "warning", 2, 1)]
    assert found[0].message.startswith("the shape-level dry run was skipped: the model's forward cannot run on example inputs (")


def test_the_dry_run_says_it_was_skipped_under_a_process_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        found = check_model(load_plan(text=PLAN.replace("tok_embeddings: rowwise", "tok_embeddings: {style: rowwise, input_layouts: replicate}"),
                                      file="plan.yaml"), meta_model(LLAMA), [2], select=["TP330"])
    finally:
        dist.destroy_process_group()
    assert [(p.code, p.severity, p.line, p.column) for p in found] == [("TP330", "warning", 2, 1)]
    assert "a process group (fake, world size 4) is already initialized" in found[0].message


# -- explicit state -----------------------------------------------------------------------------------


def test_a_model_changed_between_two_checks_is_traced_again():
    from tpplan.models.mlp import tiny

    with torch.device("meta"):
        model = tiny()
    cache = TraceCache()
    plan = load_plan(text="version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.out_proj: rowwise\n")
    first = LintContext(plan, model, [2], traces=cache).trace
    assert LintContext(plan, model, [2], traces=cache).trace is first  # unchanged: reused
    with torch.device("meta"):
        model.blocks[0].in_proj = torch.nn.Linear(model.blocks[0].in_proj.in_features, model.blocks[0].in_proj.out_features)
    assert LintContext(plan, model, [2], traces=cache).trace is not first


def test_the_collector_runs_during_the_rules_and_is_left_as_it_was(monkeypatch):
    states = []
    rule = RULES["TP360"]
    monkeypatch.setitem(RULES, "TP360", type(rule)(**{**rule.__dict__, "check": lambda ctx: states.append(gc.isenabled()) or []}))
    assert gc.isenabled()
    problems(select=["TP360"])
    assert states == [True] and gc.isenabled()


def test_facts_are_cached_properties_of_the_context():
    ctx = LintContext(load_plan(text=PLAN), meta_model(LLAMA), [2])
    assert ctx.placements is ctx.placements
    assert ctx.placements["tok_embeddings.weight"].placement == parse_placement("shard(0)")
    assert ctx.placements["layers.0.attention.wq.weight"].placement == parse_placement("shard(0)")
    assert ctx.placements["layers.0.attention.wo.weight"].placement == parse_placement("shard(1)")
    assert ctx.placements["norm.weight"].placement is None  # left a plain tensor
    ctx.kept_blocks, ctx.heads  # noqa: B018
    assert not [key for key in vars(ctx) if key.startswith("_") and key != "_traced"]  # no hidden stashes


# -- the style table --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STYLE_SPECS))
def test_every_style_entry_names_a_torch_style_and_compiles(name):
    from torch.distributed.tensor.parallel import ParallelStyle

    from tpplan.sharding.compile import compile_style
    from tpplan.sharding.styles import resolve

    spec_class = STYLE_SPECS[name]
    semantics = spec_class.semantics
    assert isinstance(semantics, StyleSemantics)
    assert issubclass(resolve(semantics.torch_class), ParallelStyle)
    contract = semantics.contract.tp
    assert set(contract.kinds) <= set(MODULE_KINDS)
    assert (contract.body == "sharded") == (semantics.inputs in ("first", "first_tensor"))
    spec = spec_class.model_construct(style=name)  # every option at its default
    if contract.body == "sharded":
        assert len(contract.outputs) == 1 and spec.natural_output() is not None and spec.declared_input()[0] is not None
    if name in ("prepare_module_output", "prepare_module_input_output"):
        return  # their output lists are required options
    assert type(compile_style(spec)) is resolve(semantics.torch_class)


def test_the_table_gives_torchs_parameter_placements():
    """What the lint believes each style does to parameters is what torch does."""
    from torch.distributed.tensor import DTensor

    from tpplan.simulation.simulate import simulated_world, tp_mesh
    from tpplan.sharding.compile import compile_style
    from tpplan.sharding.styles import module_kind

    with simulated_world(2):
        mesh = tp_mesh(2, "tp")
        for name in ("colwise", "rowwise", "sequence_parallel", "no_parallel"):
            spec_class = STYLE_SPECS[name]
            for module in (torch.nn.Linear(4, 6), torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4)):
                kind = module_kind(module)
                kinds = spec_class.semantics.contract.tp.kinds
                if kinds and kind not in kinds:
                    continue
                compile_style(spec_class(style=name))._apply(module, mesh)
                for key, param in module.named_parameters():
                    assert isinstance(param, DTensor)
                    expected = spec_class.semantics.contract.tp.placement(kind, key) or "replicate"
                    assert param.placements == (parse_placement(expected).to_torch(),), (name, kind, key)
