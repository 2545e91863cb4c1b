"""transformers model families: the shipped plans/hf/*.yaml and `import_hf`, simulated in one process.

Each run builds a tiny random-weight model (tpplan.models.hf: hidden 64, 2
layers, 8 query / 4 KV heads), applies a plan at TP 2 or 4 under a fake process
group with real per-rank values, and compares outputs and every parameter
gradient with the single-device model; the collectives of one forward and one
backward must be exactly the counts given.
"""

import functools
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from expected import llama_comms  # noqa: E402
from tpplan import load_plan  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402
from tpplan.core.aliases import TRANSFORMERS_NO_RULE, TRANSFORMERS_WITHOUT_EQUIVALENT  # noqa: E402
from tpplan.hf.importer import SOUND_STYLES, Skipped, import_hf  # noqa: E402
from tpplan.lint.fixes import added_rules  # noqa: E402
from tpplan.hf.transformers_runtime import apply_transformers_plan  # noqa: E402
from tpplan.check.verify import check_parity  # noqa: E402

PLANS = Path(__file__).resolve().parent.parent / "plans" / "hf"
L = hf_models.TINY["num_hidden_layers"]  # 2

# The same counts as our Llama under plans/llama_tp.yaml and llama_tp_sp.yaml
# (transformers' names for the same modules: o_proj and down_proj for wo and w2).
TP = llama_comms("llama_tp.yaml", L)
TP_SP = llama_comms("llama_tp_sp.yaml", L)
# Qwen2-MoE: the routed experts (expert_tp) add one all-reduce forward (their partial
# output) and two backward (their hidden states' and routing weights' input gradients)
# per layer to the dense counts.
MOE_TP = {"forward": {"all_gather": 1, "all_reduce": 3 * L + 1}, "backward": {"all_reduce": 4 * L + 1}}
# The sparse block hands back its own sequence slice (no reduce-scatter); its
# shared expert and its routed experts all-reduce forward and backward.
MOE_TP_SP = {
    "forward": {"all_gather": 2 * L + 2, "all_reduce": 2 * L, "reduce_scatter": L + 1},
    "backward": {"all_gather": 2 * L + 1, "all_reduce": 3 * L, "reduce_scatter": L + 1},
}

SHIPPED = [
    ("llama_tp.yaml", "llama", TP),
    ("llama_tp.yaml", "llama_tied", TP),
    ("llama_tp_sp.yaml", "llama", TP_SP),
    ("llama_tp_sp.yaml", "llama_tied", TP_SP),
    ("qwen2_tp.yaml", "qwen2", TP),
    ("qwen2_tp_sp.yaml", "qwen2", TP_SP),
    ("mistral_tp.yaml", "mistral", TP),
    ("mistral_tp_sp.yaml", "mistral", TP_SP),
    ("qwen2_moe_tp.yaml", "qwen2_moe", MOE_TP),
    ("qwen2_moe_tp_sp.yaml", "qwen2_moe", MOE_TP_SP),
    ("qwen3_tp.yaml", "qwen3", TP),
    # MoE families of tests/test_experts.py (also at TP 2 and 4 there, with parameter bytes).
    ("qwen3_moe_tp.yaml", "qwen3_moe", {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 3 * L + 1}}),
    ("qwen3_moe_ep.yaml", "qwen3_moe", {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 3 * L + 1}}),
    ("mixtral_tp.yaml", "mixtral", {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 3 * L + 1}}),
    ("mixtral_ep.yaml", "mixtral", {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 3 * L + 1}}),
    ("gpt_oss_tp.yaml", "gpt_oss", {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 3 * L + 1}}),
    ("gpt_oss_ep.yaml", "gpt_oss", {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 3 * L + 1}}),
    # all_to_all dispatch: real-rank parity only (tests/test_expert_all_to_all.py), never in one process.
    ("qwen3_moe_ep_sp.yaml", "qwen3_moe", None),
]
# test_experts.py runs the MoE plans at both degrees with eager (gpt-oss: sinks) attention;
# here only the families whose every plan runs both attentions.
_PARITY_HERE = {"llama", "llama_tied", "qwen2", "mistral", "qwen2_moe", "qwen3"}


def _assert_parity(result):
    assert result.passed, result.problems
    assert result.max_abs_diff < 1e-4


# Both attention implementations and both TP degrees, without the full product (time): each plan at
# both settings, one of them (alternating, so that each setting runs half the plans) in the default suite.
_SETTINGS = [("eager", 2), ("sdpa", 4)]
_SHIPPED_HERE = [case for case in SHIPPED if case[1] in _PARITY_HERE]


@pytest.mark.parametrize("plan_file, family, counts, attn, tp", [
    pytest.param(*case, attn, tp, id=f"{case[0]}-{case[1]}-{attn}-{tp}", marks=[pytest.mark.slow] if (i + j) % 2 else [])
    for i, case in enumerate(_SHIPPED_HERE) for j, (attn, tp) in enumerate(_SETTINGS)
])
def test_shipped_plan_matches_single_device_with_minimal_collectives(plan_file, family, counts, attn, tp):
    plan = load_plan(PLANS / plan_file)
    assert tp in plan.mesh_sizes
    build = functools.partial(hf_models.FACTORIES[family], attn)
    result = check_parity(build, plan, tp)
    _assert_parity(result)
    assert result.comms == counts


def test_every_shipped_hf_plan_is_tested():
    assert {path.name for path in PLANS.glob("*.yaml")} == {plan for plan, _, _ in SHIPPED}


# -- import_hf -------------------------------------------------------------------

# Collectives of transformers' own plan (imported) and with `minimal=True`. Dense
# families: q/k/v and gate/up all-reduce their input gradient one by one.
DENSE_HF = {"forward": {"all_gather": 1, "all_reduce": 2 * L}, "backward": {"all_reduce": 5 * L + 1}}
DENSE_MINIMAL = {"forward": {"all_gather": 1, "all_reduce": 2 * L}, "backward": {"all_reduce": 2 * L + 1}}
# MoE families: attention and the routed experts (expert_tp: one all-reduce forward, two
# backward per layer) are sharded.
MOE_HF = {"forward": {"all_gather": 1, "all_reduce": 2 * L}, "backward": {"all_reduce": 5 * L + 1}}
MOE_MINIMAL = {"forward": {"all_gather": 1, "all_reduce": 2 * L}, "backward": {"all_reduce": 3 * L + 1}}
# Fused qkv_proj / gate_up_proj are colwise_gather_output: each all-gathers its output
# forward; rowwise_split_input o_proj / down_proj need no input collective.
PHI3 = {
    "forward": {"all_gather": 2 * L + 1, "all_reduce": 2 * L},
    "backward": {"all_gather": 2 * L, "all_reduce": 2 * L + 1},
}
# Tied: transformers' plan shards lm_head only; the import adds the vocab-parallel embedding.
TIED_HF = {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 5 * L + 1}}

IMPORTED = [
    # family, minimal, tp, counts
    ("llama", False, 2, DENSE_HF),
    ("llama", True, 4, DENSE_MINIMAL),
    ("qwen2", False, 4, DENSE_HF),
    ("mistral", True, 4, DENSE_MINIMAL),
    ("qwen3", False, 4, DENSE_HF),  # q_norm/k_norm: local_params (gradients summed)
    ("qwen3", True, 2, DENSE_MINIMAL),
    ("phi3", False, 2, PHI3),
    ("qwen2_moe", False, 2, MOE_HF),
    ("qwen2_moe", True, 4, MOE_MINIMAL),
    ("mixtral", False, 4, MOE_HF),
    ("llama_tied", False, 4, TIED_HF),
]


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """family -> a directory holding the tiny model's config.json."""
    dirs = {}
    for family in {family for family, *_ in IMPORTED}:
        path = tmp_path_factory.mktemp(family)
        hf_models.FACTORIES[family]().config.save_pretrained(path)
        dirs[family] = path
    return dirs


@pytest.mark.parametrize(
    "family, minimal, tp, counts", IMPORTED, ids=[f"{f}-{'minimal' if m else 'hf'}-tp{tp}" for f, m, tp, _ in IMPORTED]
)
def test_imported_transformers_plan_matches_single_device(config_dirs, family, minimal, tp, counts):
    imported = import_hf(config_dirs[family], minimal=minimal, lint_fixes=added_rules)
    plan = load_plan(text=imported.text)
    assert tp in plan.mesh_sizes
    result = check_parity(functools.partial(hf_models.FACTORIES[family], "eager"), plan, tp)
    _assert_parity(result)
    assert result.comms == counts


_EXPERT_TP_INSTEAD_OF_EP = (
    f"expert_tp (every expert sharded on its intermediate dim): transformers {transformers.__version__} "
    "plans these experts only in base_model_ep_plan (whole experts per rank), which --ep imports"
)


def test_experts_planned_only_for_expert_parallelism_get_expert_tp_and_a_pointer_to_ep():
    # gpt-oss's experts are in base_model_ep_plan alone (in transformers 5.20 to 5.25; every MoE family's from 5.25)
    imported = import_hf("gpt_oss")
    assert "  model.layers.*.mlp.experts: expert_tp\n" in imported.text
    assert imported.added == [("model.layers.*.mlp.experts", _EXPERT_TP_INSTEAD_OF_EP)]
    assert f"#   model.layers.*.mlp.experts: {_EXPERT_TP_INSTEAD_OF_EP}\n" in imported.text
    assert imported.skipped == []
    # --ep: transformers' expert-parallel plan, nothing added
    ep = import_hf("gpt_oss", ep=True)
    assert "  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_reduce}\n" in ep.text
    assert [why for _, why in ep.added if "--ep" in why] == []


def test_import_maps_fused_experts_and_reports_rules_matching_nothing(config_dirs):
    imported = import_hf(config_dirs["qwen2_moe"])
    # The experts' module and parameter entries become one expert_tp rule (issue 10);
    # the dense-MLP entries match no module of an all-sparse config.
    assert [(s.key, s.hf_style) for s in imported.skipped] == [
        ("model.layers.*.mlp.gate_proj", "colwise"),
        ("model.layers.*.mlp.up_proj", "colwise"),
        ("model.layers.*.mlp.down_proj", "rowwise"),
    ]
    assert "  model.layers.*.mlp.experts: expert_tp\n" in imported.text
    whys = [why for key, why in imported.added if key == "model.layers.*.mlp.experts"]
    if "moe_tp_experts" in transformers.Qwen2MoeConfig.base_model_tp_plan.values():  # transformers <= 5.24: experts in its TP plan
        assert whys == [
            "lays out gate_up_proj (packed_colwise) as packed_shard of its gate/up dim (expert_tp's default)",
            "lays out down_proj (rowwise) as shard of its input dim (expert_tp's default)",
        ]
    else:  # 5.25 moved them to base_model_ep_plan: the same rule, and where transformers' plan for them is
        assert whys == [_EXPERT_TP_INSTEAD_OF_EP]
    reasons = {s.key: s.reason for s in imported.skipped}
    assert "matches no module" in reasons["model.layers.*.mlp.gate_proj"]
    # Every skipped entry is named in the YAML too.
    assert all(f"#   {s.key}: {s.hf_style} -- " in imported.text for s in imported.skipped)
    assert isinstance(imported.skipped[0], Skipped)


def test_import_of_a_clean_family_skips_nothing_and_groups_siblings():
    imported = import_hf("llama")  # transformers' default LlamaConfig, built on meta
    assert imported.skipped == [] and imported.added == []
    assert "  model.layers.*.self_attn.{q_proj,k_proj,v_proj}: colwise\n" in imported.text
    assert "  lm_head: {style: colwise, output_layouts: replicate}\n" in imported.text
    assert load_plan(text=imported.text).mesh_sizes == [2, 4, 8]


def test_import_of_a_tied_model_shards_the_embedding_like_lm_head(config_dirs):
    imported = import_hf(config_dirs["llama_tied"])
    assert [key for key, _ in imported.added] == ["model.embed_tokens"]
    embedding = "  model.embed_tokens: {style: rowwise, input_layouts: replicate, output_layouts: replicate}\n"
    assert embedding in imported.text


def test_every_transformers_style_is_mapped_or_reported():
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the EP styles)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES  # registers the TP styles

    known = set(SOUND_STYLES) | set(TRANSFORMERS_NO_RULE) | set(TRANSFORMERS_WITHOUT_EQUIVALENT)
    registered = set(ALL_PARALLEL_STYLES.keys())
    assert {"colwise", "rowwise", "grouped_gemm"} <= registered
    assert registered - known == set()


@pytest.mark.parametrize(
    "hf_style", ["colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input"]
)
def test_linear_styles_map_to_torch_styles_with_transformers_layouts(hf_style):
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES  # registers the styles

    from tpplan.sharding.compile import compile_style

    theirs = ALL_PARALLEL_STYLES[hf_style]
    value = SOUND_STYLES[hf_style]
    rule = json.dumps(value)  # JSON is YAML
    ours = compile_style(load_plan(text=f"version: 1\nrules:\n  x: {rule}\n").rules[0].spec)
    assert type(ours).__name__ == type(theirs).__name__  # ColwiseParallel / RowwiseParallel
    assert ours.input_layouts == (theirs.input_layouts,)
    assert ours.output_layouts == (theirs.output_layouts,)
    assert ours.use_local_output == theirs.use_local_output


def test_model_type_without_a_transformers_plan_is_a_value_error():
    with pytest.raises(ValueError, match="defines no TP plan for GPT2LMHeadModel"):
        import_hf("gpt2")


def test_unknown_model_type_is_a_value_error():
    with pytest.raises(ValueError, match="neither a config path nor a transformers model type"):
        import_hf("no-such-model")


# -- tied weights and transformers' own runtime --------------------------------------


def test_tied_weights_stay_one_parameter_through_apply():
    from tpplan.simulation.simulate import simulated_world, tp_mesh

    model = hf_models.llama_tied()
    with simulated_world(2):
        load_plan(PLANS / "llama_tp.yaml").apply(model, tp_mesh(2))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tied_parameters_laid_out_differently_are_a_located_plan_error():
    from tpplan import PlanError
    from tpplan.simulation.simulate import simulated_world, tp_mesh

    plan = load_plan(
        text="version: 1\nrules:\n  model.embed_tokens: {style: colwise, output_layouts: replicate}\n"
        "  lm_head: {style: colwise, output_layouts: replicate}\n",
        file="tied.yaml",
    )
    with simulated_world(2), pytest.raises(PlanError) as caught:
        plan.apply(hf_models.llama_tied(), tp_mesh(2))
    (problem,) = caught.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP210", 3, 3)
    assert "model.embed_tokens.weight is [S(1)], lm_head.weight is [S(0)]" in problem.message


def test_transformers_runtime_all_reduces_each_column_parallel_input():
    """transformers' own runtime and plan: same parity, 11 backward all-reduces where ours needs 5."""
    result = check_parity(hf_models.llama, apply_transformers_plan, 2)
    _assert_parity(result)
    assert result.comms == {"forward": {"all_gather": 1, "all_reduce": 2 * L}, "backward": {"all_reduce": 5 * L + 1}}


def test_import_hf_command_writes_a_plan_that_validates_against_its_model(tmp_path):
    from typer.testing import CliRunner

    from tpplan.cli.app import app

    out = tmp_path / "llama.yaml"
    result = CliRunner().invoke(app, ["import-hf", "llama", "--minimal", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "added: model.layers.*.self_attn" in result.output  # reported on stderr, not in the plan
    # The plan's mesh.sizes fit transformers' default LlamaConfig (32 KV heads); the tiny model has 4,
    # which TP 8 cannot split (TP311): check it at the degrees it has.
    checked = CliRunner().invoke(app, ["validate", str(out), "--model", "tpplan.models.hf:llama", "--tp", "2", "--tp", "4"])
    assert checked.exit_code == 0, checked.output


def test_import_hf_command_lists_what_it_leaves_out_and_rejects_unknown_types():
    from typer.testing import CliRunner

    from tpplan.cli.app import app

    moe = CliRunner().invoke(app, ["import-hf", "qwen2_moe"])
    assert moe.exit_code == 0
    assert "left out: model.layers.*.mlp.gate_proj: colwise -- matches no module" in moe.output
    assert "added: model.layers.*.mlp.experts: " in moe.output
    # experts transformers plans for expert parallelism only (gpt-oss's, every MoE family's since 5.25): expert_tp, --ep named
    oss = CliRunner().invoke(app, ["import-hf", "gpt_oss"])
    assert oss.exit_code == 0
    assert f"added: model.layers.*.mlp.experts: {_EXPERT_TP_INSTEAD_OF_EP}\n" in oss.output
    assert "matches no module" not in oss.output
    unknown = CliRunner().invoke(app, ["import-hf", "no_such_model_type"])
    assert unknown.exit_code == 2
    assert "neither a config path nor a transformers model type" in unknown.output


def test_the_importer_docstring_example_runs_as_written():
    import doctest

    from tpplan.hf import importer

    result = doctest.testmod(importer, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


def test_a_bug_inside_import_hf_is_an_internal_error_not_blamed_on_the_input(monkeypatch):
    from typer.testing import CliRunner

    from tpplan.cli.app import app

    def broken(config, model_cls):
        raise ValueError("an importer bug")  # a ValueError that is not HfImportError

    monkeypatch.setattr("tpplan.hf.importer.hf_tp_plan", broken)
    result = CliRunner().invoke(app, ["import-hf", "llama"], env={"TPPLAN_DEBUG": None})
    assert result.exit_code == 3
    assert "internal error (a bug in tpplan, not in your plan): ValueError: an importer bug" in result.output
    assert not result.output.startswith("Error:")


def test_an_unreadable_config_is_the_users_error(tmp_path):
    from typer.testing import CliRunner

    from tpplan.cli.app import app

    (tmp_path / "config.json").write_text("{not json")
    result = CliRunner().invoke(app, ["import-hf", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.startswith("Error: ")


def test_a_config_saved_by_transformers_reads_back_with_its_encoded_floats_and_a_mistyped_field_is_the_users_error(tmp_path):
    """save_pretrained writes float('inf') as {"__float__": "Infinity"} (FalconH1's time_step_limit):
    read back as transformers reads it, not as plain JSON; a field of the wrong type exits 2, not 3."""
    import json

    from transformers import FalconH1Config
    from typer.testing import CliRunner

    from tpplan.cli.app import app
    from tpplan.hf.config import load_config

    FalconH1Config().save_pretrained(tmp_path)
    assert load_config(str(tmp_path)).time_step_limit[1] == float("inf")
    data = json.loads((tmp_path / "config.json").read_text())
    data["time_step_limit"] = ["soon", 1.0]
    (tmp_path / "config.json").write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["import-hf", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.startswith("Error: ") and "time_step_limit" in result.output


def test_a_composite_config_imports_the_plan_of_the_text_config_its_causal_lm_is_built_from(tmp_path):
    # a Llama 4 checkpoint's config.json is a Llama4Config (text and vision); Llama4ForCausalLM
    # takes its text_config, as AutoModelForCausalLM.from_config picks it
    from tpplan.models.hf_any import tiny_config

    tiny_config("llama4").save_pretrained(tmp_path)
    text = import_hf(tmp_path).text
    assert "# Llama4TextConfig.base_model_tp_plan + Llama4ForCausalLM._tp_plan.\n" in text
    assert "# (Llama4TextConfig: the text_config of Llama4Config, which Llama4ForCausalLM is built from.)\n" in text
    assert "\nname: llama4-hf-tp\n" in text
    assert "  model.layers.*.self_attn.{q_proj,k_proj,v_proj}: colwise\n" in text
    assert "  lm_head: " in text
