"""A sweep over transformers' causal-LM families: for each model type, a tiny model
(tpplan.models.hf_any), `import-hf` (and `--minimal`), `validate --model` and a dry-run
`--check` at TP 2. Each family passes, or tpplan reports a located, true problem;
OUTCOMES records which (with transformers 5.24), so a false failure tpplan grows,
or a problem it stops seeing, fails here.

A handful of families run in CI (FAST); the rest are `slow` (`pytest -m slow`),
and `python tests/test_hf_sweep.py [TYPE...]` prints the table.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from families import family_params  # noqa: E402
from tpplan import load_plan  # noqa: E402
from tpplan.lint.fixes import added_rules  # noqa: E402

PASS = ("pass", None)
NO_PLAN = ("no TP plan", None)

# model type -> (stage, code) of what the sweep finds; a family not listed must pass
OUTCOMES: dict[str, tuple[str, str | None]] = {
    # transformers' plan leaves xIELU's learnable alpha_p/alpha_n (mlp.act_fn) whole between the
    # colwise up_proj and the rowwise down_proj: each rank's gradient of them covers its own
    # features only (validate: TP325, which main's lint reports instead of TP321 for a module that
    # can compute on the shard; the dry run's replica check: TP506, naming the same fix)
    "apertus": ("validate", "TP325"),
    "apertus1p5_text": ("validate", "TP325"),
    # per-head q_norm/k_norm (RMSNorm over head_dim) after the colwise q/k projections, absent from
    # transformers' plan: each rank's gradient of their weights covers its own heads only (TP325, fix named)
    "doge": ("validate", "TP325"),
    # Gemma4ForConditionalGeneration ties lm_head (colwise in transformers' plan) to the text embedding, so the
    # embedding weight is vocab-sharded too; the model's forward reads that weight whole
    # (`embed_tokens.weight[pad_token_id]` into a torch.where with plain tensors): TP330 at the embedding's rule
    "gemma4": ("validate", "TP330"),
    # Gemma 3n's first layers sparsify the MLP's activations (gaussian top-k: a cutoff from the mean and std over
    # the intermediate features), which transformers' plan shards colwise: each rank's cutoff is its own shard's
    # statistics (TP321 at gate/up_proj; the differential test's --check confirms it, TP505)
    "gemma3n_text": ("validate", "TP321"),
    # transformers shards InklingSharedExperts' raw gate/up/down_proj parameters and all-reduces its output: its own runtime fails there (bmm of a plain input with DTensor weights); the parameter entries left out (tpplan styles modules), the all-reduce sums a replicated output (TP320)
    "inkling_text": ("validate", "TP320"),
    # Llama 4's MoE adds the routed experts' output in place into the shared expert's rowwise output
    # (`out.add_(...)`), at TP a view that DTensor's to_local returns: autograd forbids the in-place
    # add, and transformers' own TP runtime fails on it the same way (validate: TP330 at the experts rule)
    "llama4": ("validate", "TP330"),
    "llama4_text": ("validate", "TP330"),  # the same MoE as llama4, its text-only causal LM
    # NOT transformers' problem but tpplan's gap: its zero-computation experts (identity_expert, transformers'
    # moe_identity_expert divides their input by the TP degree) have no tpplan style; their gate_up_proj rows
    # (routed + zero experts, 6) and down_proj's (routed, 4) have no common expert dim, which expert_tp
    # (any layout with the expert dim first) refuses: validate TP305, the dry run TP501 (was TP505 at the dry
    # run: before, expert_tp took the parameters by name and counted the zero experts' output once per rank)
    "longcat_flash": ("validate", "TP305"),
    "sarvam_moe": ("validate", "TP325"),  # as doge: q_norm/k_norm after colwise q/k, not in transformers' plan
}
FAST = ["llama", "seed_oss", "qwen3", "gpt2"]  # and apertus, in its own test below


def sweep(model_type: str, workdir: Path) -> tuple[tuple[str, str | None], str]:
    """(stage, code) of the first problem (PASS when none), and its text."""
    import torch

    from tpplan.hf.importer import import_hf
    from tpplan.models.hf_any import build, tiny_config
    from tpplan.lint.checks import check_model
    from tpplan.runtime.dryrun import dry_run
    from tpplan.simulation.modelref import ModelRefError
    from tpplan.runtime.torchrun import ApplyOptions

    try:  # transformers' own config checks and constructor on a shrunk config: not tpplan's to judge
        config = tiny_config(model_type)
        with torch.device("meta"):
            build(model_type)
        config.save_pretrained(workdir)
    except Exception as exc:
        return ("does not build", None), f"{type(exc).__name__}: {exc}"
    bodies = {}
    for minimal in (False, True):
        path = workdir / f"{'minimal' if minimal else 'hf'}.yaml"
        try:
            imported = import_hf(workdir, minimal=minimal, lint_fixes=added_rules, output=path)
        except ValueError as exc:
            if "defines no TP plan" in str(exc):
                return NO_PLAN, str(exc)
            return ("import", None), str(exc)
        body = imported.text.split("\nrules:\n", 1)[1]
        if minimal and body == bodies.get(False):
            continue  # nothing to share: the same rules as without --minimal
        bodies[minimal] = body
        path.write_text(imported.text)
        plan = load_plan(path)
        with torch.device("meta"):
            model = build(model_type)
        errors = [p for p in check_model(plan, model, [2]) if p.severity == "error"]
        if errors:
            return ("validate", errors[0].code), "\n".join(map(str, errors))
        try:
            report = dry_run(ApplyOptions(plan=str(path), model=f"tpplan.models.hf_any:{model_type.replace('-', '_')}", tp=2, check=True))
        except ModelRefError as exc:  # a multimodal model's first module is no Embedding: a usage error, true
            return ("needs --inputs", None), str(exc)
        if report.problems and report.problems[0].code == "TP500":  # the tiny model fails on one device: not a plan to judge
            return ("does not run", None), str(report.problems[0])
        if report.problems:
            return ("dry-run", report.problems[0].code), "\n".join(map(str, report.problems))
        assert report.check is not None and report.check.passed
    return PASS, ""


@pytest.mark.usefixtures("no_process_group_leaks")
@pytest.mark.parametrize("model_type", family_params(FAST))
def test_family_passes_or_gets_its_true_problem(model_type, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found, text = sweep(model_type, tmp_path)
    expected = OUTCOMES.get(model_type, PASS)
    if found[0] in ("does not build", "does not run", "no TP plan", "needs --inputs") and model_type not in OUTCOMES:
        pytest.skip(f"{model_type}: {found[0]} ({text[:200]})")
    assert found == expected, text


def test_the_apertus_problems_are_located_at_their_rules(tmp_path):
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.torchrun import ApplyOptions

    found, text = sweep("apertus", tmp_path)
    assert found == ("validate", "TP325")
    assert text.splitlines()[0].startswith(
        f"{tmp_path / 'hf.yaml'}:14:3: TP325 the local shard(-1) (2, 8, 128) that colwise 'model.layers.0.mlp.up_proj' "
        "(rule 'model.layers.*.mlp.up_proj' at "
    )
    assert "reaches 'model.layers.0.mlp.act_fn' (XIELUActivation), whose parameters 'alpha_p', 'alpha_n' no rule covers" in text
    fix = "add the rule 'model.layers.*.mlp.act_fn: local_params'"
    assert fix in text
    # the dry run's forward matches one device (xIELU is elementwise), but the replicas of its parameters diverge
    report = dry_run(ApplyOptions(plan=str(tmp_path / "hf.yaml"), model="tpplan.models.hf_any:apertus", tp=2, check=True))
    assert {(p.code, p.line, p.column) for p in report.problems} == {("TP506", 14, 3)}
    assert report.problems[0].message.startswith("at TP 2, replicated parameter 'model.layers.0.mlp.act_fn.alpha_")
    assert all(fix in p.message for p in report.problems)  # the fix TP325 names, for the same cause
    assert report.problems[0].message.endswith(
        "; located at rule 'model.layers.*.mlp.up_proj' (the rule of 'model.layers.0.mlp.up_proj', the last planned module that ran before it)"
    )


@pytest.mark.parametrize("model_type, dim", [("qwen3", -2), ("exaone4", 1), ("apertus", 1), ("qwen3_moe", -2)])
def test_per_head_norms_are_declared_on_the_dim_their_heads_are_on(tmp_path, model_type, dim):
    # Qwen3 normalizes [batch, seq, heads, head_dim]; EXAONE 4 and Apertus after the transpose;
    # Qwen3-MoE as Qwen3, found on fake tensors through its experts' float32 grouped_mm (hf.grouped_mm)
    from tpplan.hf.importer import import_hf
    from tpplan.models.hf_any import tiny_config

    tiny_config(model_type).save_pretrained(tmp_path)
    text = import_hf(tmp_path).text
    layout = f"shard({dim})"
    # local_params (main: the replicated weight's gradient summed, TP325) declaring the dim its heads are on
    assert (f"  model.layers.*.self_attn.{{q_norm,k_norm}}: {{style: local_params, input_layouts: {layout}, "
            f"desired_input_layouts: {layout}, use_local_output: true}}\n") in text


def test_a_per_head_norm_on_its_real_dim_gets_the_gradients_of_one_device_and_a_wrong_dim_is_tp320_only_when_it_moves(tmp_path):
    import torch

    from tpplan.hf.importer import import_hf
    from tpplan.models.hf_any import build, tiny_config
    from tpplan.lint.checks import check_model
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.torchrun import ApplyOptions

    tiny_config("exaone4").save_pretrained(tmp_path)
    text = import_hf(tmp_path).text
    (tmp_path / "hf.yaml").write_text(text)
    # outputs and every gradient (q_norm/k_norm's summed: local_params) as one device, replicas equal
    report = dry_run(ApplyOptions(plan=str(tmp_path / "hf.yaml"), model="tpplan.models.hf_any:exaone4", tp=2, check=True))
    assert report.problems == [] and report.check.passed
    with torch.device("meta"):
        model = build("exaone4")
    declared = "input_layouts: shard(1), desired_input_layouts: shard(1)"
    # a wrong dim declared and desired alike, handed on local, is a label: from_local then
    # to_local moves nothing, the norm computes on its heads as they arrive (--check agrees)
    (tmp_path / "label.yaml").write_text(text.replace(declared, "input_layouts: shard(-2), desired_input_layouts: shard(-2)"))
    assert [p for p in check_model(load_plan(tmp_path / "label.yaml"), model, [2]) if p.code == "TP320"] == []
    label = dry_run(ApplyOptions(plan=str(tmp_path / "label.yaml"), model="tpplan.models.hf_any:exaone4", tp=2, check=True))
    assert label.problems == [] and label.check.passed
    # redistributed from the wrong dim, it gathers the sequence: TP320 at the rule, and the run fails
    (tmp_path / "wrong.yaml").write_text(text.replace(declared, "input_layouts: shard(-2), desired_input_layouts: replicate"))
    wrong = [p for p in check_model(load_plan(tmp_path / "wrong.yaml"), model, [2]) if p.code == "TP320"]
    assert [(p.line, p.column) for p in wrong] == [(12, 3), (12, 3)]
    assert "takes its input 0 (2, 8, 8, 8) as shard(-2), but it arrives as a local shard(1)" in wrong[0].message
    failed = dry_run(ApplyOptions(plan=str(tmp_path / "wrong.yaml"), model="tpplan.models.hf_any:exaone4", tp=2, check=True))
    assert [p.code for p in failed.problems] == ["TP502"]


if __name__ == "__main__":  # python tests/test_hf_sweep.py [TYPE...]: one table row per family
    import tempfile

    for model_type in sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (stage, code), text = sweep(model_type, Path(tmp))
        print(f"| {model_type} | {stage} | {code or ''} | {text.splitlines()[0][:160] if text else ''} |", flush=True)
