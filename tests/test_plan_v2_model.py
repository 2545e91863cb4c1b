"""Plan version 2 against the model (SPEC §7's located checks that need it, what
`validate --model` runs beside the TP rules): every section's globs match modules
once each (TP200, TP201), mesh.ep divides the expert count (TP127), context_parallel
modules call an attention with a CP rule (TP128), fsdp.units nest innermost first
(TP129). Each check fails one plan at its key with its numbers and passes the
fixed twin; apply reads the same units."""

from __future__ import annotations

from functools import cache

import pytest
from typer.testing import CliRunner

from tpplan import PlanError, load_plan
from tpplan.cli.app import app
from tpplan.core.sections import fsdp_units
from tpplan.lint.checks import check_model

LLAMA = "tpplan.models.llama:tiny"
MOE = "tpplan.models.hf:qwen3_moe"  # 2 layers, 4 routed experts in model.layers.*.mlp.experts
# the lint rules are not what this file tests: resolution and the sections always run, TP329 says a failed trace
ONLY = ["TP329"]


@cache
def model(ref: str):
    from tpplan.simulation.modelref import build_model

    return build_model(ref, "meta")


def errors_of(path, ref: str) -> list:
    try:
        plan = load_plan(path)
    except PlanError as exc:
        return exc.problems
    return [p for p in check_model(plan, model(ref), [2], select=ONLY) if p.severity == "error"]


def v2(mesh: str, section: str) -> str:
    return f"version: 2\nmesh: {{{mesh}}}\nrules: {{}}\n{section}"


# (code, model, failing plan, its (line, column), words of the message, the passing twin)
TABLE = [
    # experts: keys match, once each; ep divides E of expert_parallel's modules; the modules hold experts
    ("TP200", MOE,
     v2("dp_shard: 2, tp: 2, ep: 2", "experts:\n  model.layers.*.mlp.expertz: expert_parallel\n"), (5, 3),
     "experts rule 'model.layers.*.mlp.expertz' matches no module: no child of modules matching 'model.layers.*.mlp' "
     "matches 'expertz' (children: experts, gate); did you mean 'model.layers.*.mlp.experts'?",
     v2("dp_shard: 2, tp: 2, ep: 2", "experts:\n  model.layers.*.mlp.experts: expert_parallel\n")),
    ("TP201", MOE,
     v2("dp_shard: 2, tp: 2, ep: 2", "experts:\n  model.layers.*.mlp.experts: expert_parallel\n  model.layers.0.mlp.experts: expert_tp\n"),
     (6, 3),
     "experts rule 'model.layers.0.mlp.experts' (line 6) and experts rule 'model.layers.*.mlp.experts' (line 5) both "
     "match 'model.layers.0.mlp.experts': a module takes one style, narrow one of the globs",
     v2("dp_shard: 2, tp: 2, ep: 2", "experts:\n  model.layers.1.mlp.experts: expert_parallel\n  model.layers.0.mlp.experts: expert_tp\n")),
    ("TP127", MOE,
     v2("dp_shard: 4, tp: 2, ep: 8", "experts:\n  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_to_all}\n"),
     (2, 32),
     "mesh.ep: 8 does not divide the 4 experts of 'model.layers.0.mlp.experts' (and 1 more) (experts rule "
     "'model.layers.*.mlp.experts', line 5): expert_parallel gives each ep rank 4 / ep whole experts; make ep one of 1, 2, 4",
     v2("dp_shard: 4, tp: 2, ep: 4", "experts:\n  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_to_all}\n")),
    ("TP127", MOE,
     v2("dp_shard: 2, tp: 2, ep: 2", "experts:\n  model.layers.*.post_attention_layernorm: expert_parallel\n"), (5, 3),
     "experts rule 'model.layers.*.post_attention_layernorm' on 'model.layers.0.post_attention_layernorm': "
     "expert_parallel needs a module whose own parameters all have the expert dim first",
     v2("dp_shard: 2, tp: 2, ep: 2", "experts:\n  model.layers.*.mlp.experts: expert_parallel\n")),
    # context_parallel: modules match, once each, and call SDPA
    ("TP200", LLAMA,
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: layers.*.atention\n"), (5, 12),
     "context_parallel.modules: 'layers.*.atention' matches no module: no child of modules matching 'layers.*' matches "
     "'atention'",
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: layers.*.attention\n")),
    ("TP201", LLAMA,
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: [layers.*.attention, '**.attention']\n"), (5, 33),
     "context_parallel.modules: '**.attention' (line 5, column 33) and 'layers.*.attention' (column 13) both match "
     "'layers.0.attention', 'layers.1.attention': context parallelism wraps a module's attention once",
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: ['**.attention']\n")),
    ("TP128", LLAMA,
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules:\n    - layers.*.attention\n    - layers.*.feed_forward\n"), (7, 7),
     "context_parallel.modules: 'layers.*.feed_forward' matches 'layers.0.feed_forward', 'layers.1.feed_forward', "
     "whose forward calls no torch.nn.functional.scaled_dot_product_attention: CP without a supported attention",
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules:\n    - layers.*.attention\n")),
    ("TP128", LLAMA,  # a block holds its attention: its forward calls SDPA through it
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: layers.*.attention.wq\n"), (5, 12),
     "'layers.*.attention.wq' matches 'layers.0.attention.wq', 'layers.1.attention.wq', whose forward calls no",
     v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: layers.*\n")),
    # fsdp.units: match, once each, innermost first, the root last
    ("TP200", LLAMA,
     v2("dp_shard: 2", "fsdp:\n  units: [layers.*, blocks.*, '']\n"), (5, 21),
     "fsdp.units: 'blocks.*' matches no module: no child of the root module matches 'blocks'",
     v2("dp_shard: 2", "fsdp:\n  units: [layers.*, '']\n")),
    ("TP201", LLAMA,
     v2("dp_shard: 2", "fsdp:\n  units: [layers.*, layers.1]\n"), (5, 21),
     "fsdp.units: 'layers.1' (line 5, column 21) and 'layers.*' (column 11) both match 'layers.1': fully_shard wraps a "
     "module once, narrow one of the globs",
     v2("dp_shard: 2", "fsdp:\n  units: [layers.0, layers.1]\n")),
    ("TP129", LLAMA,
     v2("dp_shard: 2", "fsdp:\n  units:\n    - layers.*\n    - layers.*.attention\n    - ''\n"), (7, 7),
     "fsdp.units: 'layers.*.attention' (its 'layers.0.attention') is listed after 'layers.*' (line 6), whose 'layers.0' "
     "holds it: fully_shard wraps units innermost first",
     v2("dp_shard: 2", "fsdp:\n  units:\n    - layers.*.attention\n    - layers.*\n    - ''\n")),
    ("TP129", LLAMA,
     v2("dp_shard: 2", "fsdp:\n  units: ['', layers.*]\n"), (5, 11),
     "fsdp.units: \"\" (the root, which holds every module) is listed before 'layers.*'",
     v2("dp_shard: 2", "fsdp:\n  units: [layers.*, '']\n")),
    ("TP129", LLAMA,
     v2("dp_shard: 2", "fsdp:\n  units: ['layers.**']\n"), (5, 11),
     "fsdp.units: 'layers.**' matches both 'layers' and 'layers.0' inside it",
     v2("dp_shard: 2", "fsdp:\n  units: ['layers.*']\n")),
    # checkpointing.modules: match, once each
    ("TP200", LLAMA,
     v2("dp_shard: 2", "checkpointing:\n  modules: [layers.*, norms]\n"), (5, 23),
     "checkpointing.modules: 'norms' matches no module: no child of the root module matches 'norms' (children: layers, "
     "norm, output, tok_embeddings); did you mean 'norm'?",
     v2("dp_shard: 2", "checkpointing:\n  modules: [layers.*, norm]\n")),
    ("TP201", LLAMA,
     v2("dp_shard: 2", "checkpointing:\n  modules: [layers.*, layers.0]\n"), (5, 23),
     "both match 'layers.0': a module's activations are recomputed by one wrapper",
     v2("dp_shard: 2", "checkpointing:\n  modules: [layers.*]\n")),
    # a list section's glob that is no glob: at load, at the glob
    ("TP110", LLAMA,
     v2("dp_shard: 2", "checkpointing:\n  modules: [layers.*, 'layers.[0']\n"), (5, 23),
     "checkpointing.modules: bad glob 'layers.[0'",
     v2("dp_shard: 2", "checkpointing:\n  modules: [layers.*, 'norm']\n")),
    # pipeline: the stages cut the model between its blocks, each module with parameters in one stage, in order
    ("TP154", LLAMA, v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.0.attention'], ['layers.1', norm, output]]\n"),
     (5, 29),
     "pipeline.stages[0]: 'layers.0.attention' is inside 'layers.0': a stage takes whole units (cut between the blocks of layers); name 'layers.0'",
     v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.0'], ['layers.1', norm, output]]\n")),
    ("TP154", LLAMA, v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.{1..0}'], [norm, output]]\n"), (5, 29),
     "pipeline.stages[0]: 'layers.{1..0}': the range {1..0} runs backwards: write {0..1}",
     v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.{0..1}'], [norm, output]]\n")),
    ("TP155", LLAMA, v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.{0..1}'], ['layers.1', norm, output]]\n"), (5, 48),
     "pipeline.stages[1]: 'layers.1' is in stage 0 already: a module runs in one stage",
     v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.0'], ['layers.1', norm, output]]\n")),
    ("TP155", LLAMA, v2("pp: 2, tp: 1", "pipeline:\n  stages: [['layers.1', tok_embeddings], ['layers.0', norm, output]]\n"), (5, 13),
     "pipeline.stages[0]: 'layers.1' comes after 'layers.0' (stage 1) in the model: the stages follow the model's order",
     v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.0'], ['layers.1', norm, output]]\n")),
    ("TP156", LLAMA, v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.0'], ['layers.1', norm]]\n"), (5, 11),
     "pipeline.stages: 1 module(s) with parameters are in no stage: output; every one runs in exactly one stage",
     v2("pp: 2, tp: 1", "pipeline:\n  stages: [[tok_embeddings, 'layers.0'], ['layers.1', norm, output]]\n")),
    ("TP157", LLAMA, v2("pp: 2, tp: 1", "pipeline:\n  layers_per_stage: 2\n"), (5, 21),
     "pipeline.layers_per_stage: 2 blocks of layers do not make pp·virtual_stages = 2·1 = 2 stages of 2: give layers_per_stage 1",
     v2("pp: 2, tp: 1", "pipeline:\n  layers_per_stage: 1\n")),
    # a parameter two stages share (a head tied to the embeddings) would be trained as two copies
    ("TP159", "tpplan.models.hf:llama_tied", v2("pp: 2, tp: 1", "pipeline:\n  layers_per_stage: 1\n"), (5, 21),
     "pipeline: 'model.embed_tokens.weight' (stage 0) and 'lm_head.weight' (stage 1) are one tied parameter",
     v2("pp: 1, tp: 1", "pipeline:\n  layers_per_stage: 2\n")),
]


@pytest.mark.parametrize("code, ref, failing, at, words, passing", TABLE, ids=[f"{row[0]}-{i}" for i, row in enumerate(TABLE)])
def test_each_model_check_fails_its_plan_at_the_key_and_passes_the_fixed_one(tmp_path, code, ref, failing, at, words, passing):
    plan = tmp_path / "plan.yaml"
    plan.write_text(failing)
    [problem] = errors_of(plan, ref)
    assert (problem.code, problem.file, (problem.line, problem.column)) == (code, str(plan), at)
    assert words in problem.message
    plan.write_text(passing)
    assert errors_of(plan, ref) == []


def test_validate_model_prints_the_section_problems_located_and_exits_1_without_a_traceback(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: layers.*.feed_forward\nfsdp:\n  units: ['', layers.*]\n"))
    result = CliRunner().invoke(app, ["validate", str(plan), "--model", LLAMA])
    assert result.exit_code == 1, result.output
    assert f"{plan}:5:12: TP128 context_parallel.modules: 'layers.*.feed_forward'" in result.output
    assert f"{plan}:7:11: TP129 fsdp.units: \"\" (the root" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_an_eager_attention_has_no_cp_rule_and_the_same_model_with_sdpa_has(tmp_path):
    from tpplan.models.hf import qwen3_moe
    from tpplan.simulation.modelref import build_model

    plan = tmp_path / "plan.yaml"
    plan.write_text(v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: model.layers.*.self_attn\n"))
    found = {}
    for attention in ("eager", "sdpa"):
        built = build_model(MOE, "meta", lambda: qwen3_moe(attention))
        found[attention] = [p.code for p in check_model(load_plan(plan), built, [2], select=ONLY) if p.severity == "error"]
    assert found == {"eager": ["TP128"], "sdpa": []}


def test_apply_wraps_the_units_innermost_first_as_listed_and_the_root_last(tmp_path):
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(v2("dp_shard: 2", "fsdp:\n  units: [layers.*.attention, layers.*, '']\n"))
    plan = load_plan(plan_path)
    tree, under = plan.module_tree(model(LLAMA))
    assert fsdp_units(plan, tree, under) == (["layers.0.attention", "layers.1.attention", "layers.0", "layers.1", ""], [])


def test_apply_refuses_units_out_of_order_before_sharding_anything(tmp_path):
    from tpplan.models.llama import tiny
    from tpplan.sharding.data_parallel import data_parallel_of, unit_modules

    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(v2("dp_shard: 2", "fsdp:\n  units: [layers.*, layers.*.attention, '']\n"))
    plan = load_plan(plan_path)
    with pytest.raises(PlanError) as info:
        unit_modules(plan, tiny(), data_parallel_of(plan))
    [problem] = info.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP129", 5, 21)


def test_without_a_trace_cp_is_not_decided_and_the_warning_says_so(tmp_path):
    # conv_first's forward has no default inputs: nothing is claimed about its attention either way
    plan = tmp_path / "plan.yaml"
    plan.write_text(v2("dp_shard: 2, cp: 2", "context_parallel:\n  modules: proj\n"))
    found = check_model(load_plan(plan), model("tpplan.models.rule_examples:conv_first"), [2], select=ONLY)
    assert [p.code for p in found] == ["TP329"]
    assert found[0].message.endswith("and context parallelism's attention (TP128)")
