"""Styles a plan names by class (`style: PKG.MOD:Class`): plan-only validation
imports nothing, `--model` imports the class and reports what is wrong at the
rule (TP306), `like:` gives the lint a built-in style's semantics and without
it the lint says once that it treats the module as opaque (TP307). The classes
are a user's own, defined here, and torchao's Float8 styles where torchao
imports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from lint_helpers import meta_model
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from typer.testing import CliRunner

from tpplan import PlanError, load_plan
from tpplan.cli.app import app
from tpplan.lint.checks import check_model

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

ROOT = Path(__file__).resolve().parent.parent
TORCH_TP = "torch.distributed.tensor.parallel"


class CountingColwise(ColwiseParallel):
    """A user's style: torch's colwise that records where it was applied (and a tag)."""

    applied: list[str] = []

    def __init__(self, *, tag: str, **kwargs):
        super().__init__(**kwargs)
        self.tag = tag

    def _apply(self, module, device_mesh):
        type(self).applied.append(f"{self.tag}:{type(module).__name__}")
        return super()._apply(module, device_mesh)


class Refusing(RowwiseParallel):
    def __init__(self, **kwargs):
        raise ValueError("this style needs a Float8Linear")


class ShardedLinear(ParallelStyle):
    """A user's own style, like none of tpplan's (a plan names it without `like:`): the
    module's own parameters laid out by `params` (any other replicated), its first input
    annotated as `input_layouts` and redistributed to `desired_input_layouts`, its output
    redistributed to `output_layouts` (None: as the module leaves it)."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, output_layouts=None, params=None, use_local_output=True):
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.desired_input_layouts = desired_input_layouts or self.input_layouts
        self.output_layouts, self.params, self.use_local_output = output_layouts, dict(params or {}), use_local_output

    def _partition(self, name, module, mesh):
        for key, param in list(module.named_parameters(recurse=False)):
            placed = distribute_tensor(param, mesh, [self.params.get(key, Replicate())], src_data_rank=self.src_data_rank)
            module.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))

    def _input(self, module, inputs, mesh):
        first = inputs[0] if isinstance(inputs[0], DTensor) else DTensor.from_local(inputs[0], mesh, (self.input_layouts,), run_check=False)
        return (first.redistribute(placements=(self.desired_input_layouts,)), *inputs[1:])

    def _output(self, module, output, mesh):
        if self.output_layouts is not None:
            output = output.redistribute(placements=(self.output_layouts,))
        return output.to_local() if self.use_local_output else output

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)


NOT_A_STYLE = 3


def plan_with(wq: str, wo: str = "rowwise") -> str:
    return (
        "version: 1\nrules:\n  tok_embeddings: {style: rowwise, input_layouts: replicate}\n"
        f"  layers.*.attention.w{{q,k,v}}: {wq}\n  layers.*.attention.wo: {wo}\n"
        "  layers.*.feed_forward.w{1,3}: colwise\n  layers.*.feed_forward.w2: rowwise\n"
        "  output: {style: colwise, output_layouts: replicate}\n"
    )


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return str(path)


def test_plan_only_validation_never_imports_the_class(tmp_path):
    plan = write(tmp_path, plan_with("{style: not_installed_anywhere.styles:Colwise, like: colwise, tag: x}"))
    result = run("validate", plan)
    assert result.exit_code == 0, result.output
    assert "not_installed_anywhere" not in sys.modules
    [rule] = [r for r in load_plan(plan).rules if r.pattern == "layers.*.attention.w{q,k,v}"]
    assert rule.spec.torch_class() == "not_installed_anywhere.styles:Colwise"
    assert rule.spec.torch_options() == {"tag": "x"}  # only what the rule wrote: the class may not take colwise's defaults


def test_placements_are_written_as_in_the_plan_for_any_argument():
    plan = load_plan(text="version: 1\nrules:\n  a: {style: pkg.mod:Style, layouts: [shard(0), replicate], dim: 2, name: x}\n")
    options = plan.rules[0].spec.torch_options()
    assert [str(p) for p in options["layouts"]] == ["shard(0)", "replicate"] and options["dim"] == 2 and options["name"] == "x"


def test_a_like_style_keeps_that_styles_checks(problems):
    text = "version: 1\nrules:\n  a: {style: pkg.mod:Style, like: colwise, output_layouts: shard(9x)}\n"
    assert problems(text) == [("TP104", 3, text.splitlines()[2].index("shard(9x)") + 1)]
    bad_like = "version: 1\nrules:\n  a: {style: pkg.mod:Style, like: colwize}\n"
    assert problems(bad_like) == [("TP101", 3, bad_like.splitlines()[2].index("colwize") + 1)]
    assert problems("version: 1\nrules:\n  a: {style: 'pkg.mod:'}\n") == [("TP103", 3, 14)]


def test_the_json_schema_accepts_the_form_and_refuses_a_bad_like():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "schemas/plan.schema.json").read_text())
    good = {"version": 1, "rules": {"a": {"style": "torchao.float8:Float8ColwiseParallel", "like": "colwise", "x": [1]}, "b": "pkg.mod:Style"}}
    jsonschema.validate(good, schema)
    for bad in ({"style": "pkg.mod:Style", "like": "colwize"}, {"style": "pkg.mod:"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"version": 1, "rules": {"a": bad}}, schema)


def test_a_class_that_does_not_import_is_TP306_at_the_rule(tmp_path):
    plan = write(tmp_path, plan_with("{style: not_installed_anywhere.styles:Colwise, like: colwise}"))
    result = run("validate", plan, "--model", "tpplan.models.llama:tiny", "--format", "json")
    assert result.exit_code == 1
    [problem] = [p for p in json.loads(result.output)["problems"] if p["severity"] == "error"]
    assert (problem["code"], problem["line"], problem["column"]) == ("TP306", 4, 3)
    assert problem["message"] == ("rule 'layers.*.attention.w{q,k,v}': style 'not_installed_anywhere.styles:Colwise' cannot be "
                                  "imported: no module named 'not_installed_anywhere' (is it installed?)")


@pytest.mark.parametrize("wq, message", [
    ("{style: test_external_styles:NoSuch, like: colwise}", "style 'test_external_styles:NoSuch': module 'test_external_styles' has no attribute 'NoSuch'"),
    ("{style: test_external_styles:NOT_A_STYLE, like: colwise}", "style 'test_external_styles:NOT_A_STYLE' is a int, not a subclass of torch's ParallelStyle"),
    ("{style: torch.nn:Linear, like: colwise}", "style 'torch.nn:Linear' is the class Linear, not a subclass of torch's ParallelStyle"),
    (f"{{style: '{TORCH_TP}:ColwiseParallel', like: colwise, heads: 2}}", "ColwiseParallel takes no argument 'heads' (it takes input_layouts, output_layouts, use_local_output)"),
])
def test_a_class_that_cannot_be_used_says_why(wq, message):
    problems = check_model(load_plan(text=plan_with(wq)), meta_model("tpplan.models.llama:tiny"), [2])
    assert [(p.code, p.line, p.message) for p in problems if p.severity == "error"] == [
        ("TP306", 4, f"rule 'layers.*.attention.w{{q,k,v}}': {message}")
    ]


def test_a_constructor_that_raises_is_TP306_when_the_plan_is_applied(tmp_path):
    plan = write(tmp_path, plan_with("colwise", wo="{style: test_external_styles:Refusing, like: rowwise}"))
    result = run("apply", "--dry-run", "--tp", "2", "--model", "tpplan.models.llama:tiny", "--plan", plan)
    assert result.exit_code == 1, result.output
    assert "TP306 rule 'layers.*.attention.wo': Refusing(...) raised ValueError: this style needs a Float8Linear" in result.output


def test_an_external_style_like_colwise_lints_as_colwise():
    model = meta_model("tpplan.models.llama:tiny")
    builtin = check_model(load_plan(text=plan_with("colwise", wo="{style: rowwise, input_layouts: shard(0)}")), model, [2])
    external = check_model(load_plan(text=plan_with(
        f"{{style: '{TORCH_TP}:ColwiseParallel', like: colwise}}", wo=f"{{style: '{TORCH_TP}:RowwiseParallel', like: rowwise, input_layouts: shard(0)}}"
    )), model, [2])
    assert [p.code for p in builtin] == [p.code for p in external]
    assert "TP320" in [p.code for p in external]  # the wrong input layout is found through the external style


def test_without_like_the_lint_says_once_that_the_module_is_opaque():
    plan = load_plan(text=plan_with(f"{{style: '{TORCH_TP}:ColwiseParallel'}}", wo=f"{{style: '{TORCH_TP}:RowwiseParallel', input_layouts: shard(0)}}"))
    problems = check_model(plan, meta_model("tpplan.models.llama:tiny"), [2])
    opaque = [p for p in problems if p.code == "TP307"]
    assert [(p.line, p.severity) for p in opaque] == [(4, "warning"), (5, "warning")]
    assert opaque[0].message.startswith(
        f"rule 'layers.*.attention.w{{q,k,v}}' names {TORCH_TP}:ColwiseParallel without 'like:': the lint does not know its "
        "layouts, so it judges nothing in or after the 6 modules it matches"
    )
    assert "TP320" not in [p.code for p in problems]  # not judged: the module is opaque


def test_a_users_style_runs_in_the_dry_run_and_passes_the_check(tmp_path):
    CountingColwise.applied.clear()
    plan = write(tmp_path, plan_with("{style: test_external_styles:CountingColwise, like: colwise, tag: q}"))
    result = run("apply", "--dry-run", "--tp", "2", "--model", "tpplan.models.llama:tiny", "--plan", plan, "--check")
    assert result.exit_code == 0, result.output
    assert "check against a single device: passed" in result.output
    assert set(CountingColwise.applied) == {"q:Linear"} and len(CountingColwise.applied) % 6 == 0  # 3 per layer, 2 layers, per build


def sharded_linear_plan(**layouts: str) -> str:
    """The MLP's in_proj as a ShardedLinear with `layouts` (its weight and bias shard(0): colwise's), out_proj rowwise."""
    keys = "".join(f", {key}: {value}" for key, value in layouts.items())
    return (
        "version: 1\nrules:\n"
        f"  blocks.*.in_proj: {{style: test_external_styles:ShardedLinear, params: {{weight: shard(0), bias: shard(0)}}{keys}}}\n"
        "  blocks.*.out_proj: rowwise\n"
    )


MLP = "tpplan.models.mlp:tiny"


def test_without_like_the_lint_follows_the_layouts_the_rule_gives():
    """A class like none of the built-in styles, its layouts stated in the rule: the lint
    judges its input and what its output feeds as the rule says, and the verdict follows
    the layouts: handing on a feature shard suits the rowwise after it, a replicated output
    does not (TP320 at out_proj), an input declared sharded that arrives whole is TP320 at
    in_proj; with no output layout the lint says what it cannot follow (TP307)."""
    def found(**layouts):  # (code, line) of each problem; line 3 is in_proj's rule, 4 out_proj's
        return [(p.code, p.line) for p in check_model(load_plan(text=sharded_linear_plan(**layouts)), meta_model(MLP), [2])]

    assert found(input_layouts="replicate", output_layouts="'shard(-1)'") == []
    assert found(input_layouts="replicate", output_layouts="replicate") == [("TP320", 4)]
    assert found(input_layouts="'shard(0)'", output_layouts="'shard(-1)'") == [("TP320", 3), ("TP320", 3)]  # each block's in_proj
    assert found() == [("TP307", 3)]  # params alone: its inputs judged, its outputs unknown
    opaque = check_model(load_plan(text=sharded_linear_plan()), meta_model(MLP), [2])[0]
    assert "with no 'like:' or 'output_layouts'" in opaque.message


def test_a_user_style_without_like_runs_as_its_layouts_say_in_the_dry_run(tmp_path):
    """The layouts the lint followed are what the class does: the dry run's check passes and
    in_proj's weight is sharded as `params` says."""
    plan = write(tmp_path, sharded_linear_plan(input_layouts="replicate", output_layouts="'shard(-1)'"))
    result = run("apply", "--dry-run", "--tp", "2", "--model", MLP, "--plan", plan, "--check", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["check"]["passed"]
    weight = report["parameters"]["blocks.0.in_proj.weight"]
    assert (weight["placements"], weight["local_shapes"]) == ("shard(0)", [[64, 32], [64, 32]])
    # as colwise + rowwise: the output all-reduced per block, block 1's input gradient summed
    assert report["comms"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 1}}


def test_a_layout_key_of_a_class_without_like_is_a_placement():
    with pytest.raises(PlanError, match="'sideways' is not a placement"):
        load_plan(text="version: 1\nrules:\n  x: {style: a.b:C, output_layouts: sideways}\n")


def float8_llama():
    """tpplan's tiny Llama with torchao's Float8Linear everywhere but the head."""
    from torchao.float8 import convert_to_float8_training

    from tpplan.models.llama import tiny

    return convert_to_float8_training(tiny(), module_filter_fn=lambda module, fqn: fqn != "output")


F8 = "torchao.float8.float8_tensor_parallel"
F8_PLAN = plan_with(f"{{style: '{F8}:Float8ColwiseParallel', like: colwise}}", wo=f"{{style: '{F8}:Float8RowwiseParallel', like: rowwise}}")


def test_torchaos_float8_styles_lint_as_the_styles_they_are_like():
    pytest.importorskip("torchao.float8")
    model = meta_model("test_external_styles:float8_llama")
    problems = check_model(load_plan(text=F8_PLAN), model, [2])
    builtin = check_model(load_plan(text=plan_with("colwise")), model, [2])
    assert [p.code for p in problems] == [p.code for p in builtin] == ["TP340", "TP340"]  # q/k/v and w1/w3 share no input


def test_torchaos_float8_styles_shard_a_float8_model_in_the_dry_run(tmp_path):
    pytest.importorskip("torchao.float8")
    plan = write(tmp_path, F8_PLAN)
    result = run("apply", "--dry-run", "--tp", "2", "--model", "test_external_styles:float8_llama", "--plan", plan, "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["params"]
