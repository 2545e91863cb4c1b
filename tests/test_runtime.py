"""The pieces of `tpplan apply` that need no second process: MOD:FN references,
devices and meshes, plan consensus (as data), located application, layouts,
the parity comparison and SGD steps.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tpplan import load_plan
from tpplan.simulation.modelref import ModelRefError, build_model, load_callable, make_inputs, module_structure
from tpplan.models import llama, mlp
from tpplan.core.problems import PlanError
from tpplan.runtime.consensus import disagreements, rank_state
from tpplan.runtime.devices import BACKENDS, mesh_shape, pick_device, torchrun_env
from tpplan.simulation.layouts import param_layouts
from tpplan.simulation.locate import apply_located
from tpplan.cli.apply import worded
from tpplan.runtime.options import UsageError
from tpplan.runtime.steps import sgd_steps
from tpplan.check.verify import compare_with_reference
from tpplan.simulation.simulate import simulated_world, tp_mesh

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"


pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write `usermod.py` with the given source and make it importable."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str, name: str = "usermod") -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        sys.modules.pop(name, None)
        return path

    yield write
    sys.modules.pop("usermod", None)


# -- MOD:FN references ----------------------------------------------------------------


def test_model_reference_without_a_colon_is_a_usage_error():
    with pytest.raises(ModelRefError, match=r"--model 'tpplan.models.llama' must be MODULE:FUNCTION"):
        load_callable("tpplan.models.llama")


def test_missing_module_is_named_as_not_found():
    with pytest.raises(ModelRefError, match=r"no module named 'no_such_pkg'"):
        load_callable("no_such_pkg.models:tiny", "--inputs")


def test_missing_attribute_lists_the_factories_the_module_defines():
    with pytest.raises(ModelRefError) as caught:
        load_callable("tpplan.models.mlp:small")
    message = str(caught.value)
    assert "module 'tpplan.models.mlp' has no attribute 'small'; it defines tiny, MLP, MLPBlock" in message


def test_a_broken_import_inside_the_user_module_is_located_not_reported_as_missing(user_module):
    path = user_module("""\
        import math
        import not_installed_dependency
    """)
    with pytest.raises(ModelRefError) as caught:
        load_callable("usermod:build")
    assert f"importing 'usermod' failed: ModuleNotFoundError: No module named 'not_installed_dependency' (at {path}:2)" in str(caught.value)


def test_factory_that_raises_is_tp500_at_the_line_that_raised(user_module):
    path = user_module("""\
        def build():
            raise ValueError("n_heads (12) must divide dim (128)")
    """)
    with pytest.raises(PlanError) as caught:
        build_model("usermod:build", "meta")
    (problem,) = caught.value.problems
    assert (problem.code, problem.file, problem.line) == ("TP500", str(path), 2)
    assert problem.message == "building the model (usermod:build) failed: ValueError: n_heads (12) must divide dim (128)"


def test_a_factory_failing_inside_torch_is_tp500_at_its_own_line_not_torchs(user_module):
    path = user_module("""\
        import torch

        def build():
            return torch.nn.Linear(4, -1)
    """)
    with pytest.raises(PlanError) as caught:
        build_model("usermod:build", "meta")
    (problem,) = caught.value.problems
    assert (problem.code, problem.file, problem.line) == ("TP500", str(path), 4)
    assert "negative dimension" in problem.message


def test_factory_returning_a_non_module_is_tp500_at_its_definition(user_module):
    path = user_module("""\
        import torch

        def build():
            return {"not": "a module"}
    """)
    with pytest.raises(PlanError) as caught:
        build_model("usermod:build", "meta")
    (problem,) = caught.value.problems
    assert (problem.code, problem.file, problem.line) == ("TP500", str(path), 3)
    assert "returned a dict, not a torch.nn.Module" in problem.message


def test_model_is_built_under_the_requested_device():
    model = build_model("tpplan.models.llama:llama3_8b", "meta")
    assert model.output.weight.device.type == "meta"
    assert model.output.weight.shape == (128256, 4096)


def test_inputs_factory_runs_under_the_device_and_a_single_tensor_becomes_a_tuple(user_module):
    user_module("""\
        import torch

        def tokens():
            return torch.zeros(2, 4, dtype=torch.long)

        def not_tensors():
            return (torch.zeros(1), "mask")
    """)
    (tokens,) = make_inputs("usermod:tokens", None, "meta")
    assert tokens.device.type == "meta" and tokens.shape == (2, 4)
    with pytest.raises(PlanError, match=r"must return a tensor or a tuple of tensors, got Tensor, str"):
        make_inputs("usermod:not_tensors", None, "cpu")


def test_default_inputs_follow_the_first_module():
    (tokens,) = make_inputs(None, llama.tiny(), "cpu")
    assert tokens.dtype == torch.long and tokens.max() < 256
    (floats,) = make_inputs(None, mlp.tiny(), "cpu")
    assert floats.is_floating_point() and floats.shape[-1] == 32


# -- devices and meshes -----------------------------------------------------------------


def test_backend_follows_the_device():
    assert BACKENDS == {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def test_device_auto_is_cpu_without_accelerators_and_missing_ones_are_usage_errors():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert pick_device("auto") == "cpu"
    assert pick_device("cpu") == "cpu"
    with pytest.raises(UsageError, match="torch sees no CUDA device"), worded():
        pick_device("cuda")
    with pytest.raises(UsageError, match="needs torch_npu"), worded():
        pick_device("npu")


def test_world_size_mesh_is_one_dimensional_and_a_smaller_tp_adds_a_dp_dim():
    assert mesh_shape(4, None, "tp") == ((4,), ("tp",))
    assert mesh_shape(4, 4, "model") == ((4,), ("model",))
    assert mesh_shape(4, 2, "tp") == ((2, 2), ("dp", "tp"))
    assert mesh_shape(8, 2, "tp") == ((4, 2), ("dp", "tp"))


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_that_does_not_divide_the_world_is_a_usage_error(tp):
    with pytest.raises(UsageError, match=rf"--tp \({tp}\) must divide the world size \(4\)"), worded():
        mesh_shape(4, tp, "tp")


def test_outside_torchrun_apply_says_how_to_launch_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError) as caught, worded():
        torchrun_env()
    assert "torchrun --nproc-per-node N -m tpplan apply" in str(caught.value)
    assert "--dry-run --tp N" in str(caught.value)


# -- plan consensus ---------------------------------------------------------------------


def _states(plans: list, models: list | None = None, hosts: list[str] | None = None) -> list[dict]:
    models = models or [llama.tiny] * len(plans)
    states = []
    for rank, (plan, build) in enumerate(zip(plans, models)):
        with torch.device("meta"):
            structure = module_structure(build())
        state = rank_state(rank, plan, structure, [], None)
        if hosts:
            state["host"] = hosts[rank]
        states.append(state)
    return states


def test_ranks_with_the_same_plan_and_model_agree():
    plan = load_plan(PLANS / "llama_tp.yaml")
    assert disagreements(_states([plan, plan, plan])) == ([], [])


def test_same_meaning_in_another_file_is_the_same_plan(tmp_path):
    copy = tmp_path / "copy.yaml"
    copy.write_text("# reformatted\n" + (PLANS / "mlp_tp.yaml").read_text().replace("name: mlp-tp", "name: renamed"))
    plans = [load_plan(PLANS / "mlp_tp.yaml"), load_plan(copy)]
    assert disagreements(_states(plans, [mlp.tiny, mlp.tiny])) == ([], [])


def test_different_plans_name_the_ranks_and_the_rules_that_differ():
    tp, sp = load_plan(PLANS / "llama_tp.yaml"), load_plan(PLANS / "llama_tp_sp.yaml")
    usage, problems = disagreements(_states([tp, tp, sp, tp]))
    assert usage == []
    (problem,) = problems
    assert problem.code == "TP503"
    # Located at the first rule of rank 0's plan that differs.
    first = tp.rules[0]
    assert (problem.file, problem.line, problem.column) == (str(PLANS / "llama_tp.yaml"), first.line, first.column)
    assert problem.message.startswith(f"the ranks hold different plans: ranks 0, 1, 3 {PLANS / 'llama_tp.yaml'} (fingerprint {tp.fingerprint()}), rank 2 ")
    assert (
        "rule 'tok_embeddings' is {style: rowwise, input_layouts: replicate} on ranks 0, 1, 3 "
        "but {style: rowwise, input_layouts: replicate, output_layouts: shard(1)} on rank 2" in problem.message
    )
    assert "and 5 more; every rank must load the same plan" in problem.message


def test_a_changed_setting_is_named_with_both_values(tmp_path):
    changed = tmp_path / "mlp.yaml"
    changed.write_text((PLANS / "mlp_tp.yaml").read_text().replace("src_data_rank: 0", "src_data_rank: null"))
    plans = [load_plan(PLANS / "mlp_tp.yaml"), load_plan(changed)]
    (problem,) = disagreements(_states(plans, [mlp.tiny, mlp.tiny]))[1]
    assert "src_data_rank is 0 on rank 0 but null on rank 1" in problem.message


def test_different_models_name_the_modules_that_differ():
    # Missing modules come first, then parameter shapes: the former usually explain the latter.
    plan = load_plan(PLANS / "mlp_tp.yaml")
    (problem,) = disagreements(_states([plan, plan], [mlp.tiny, lambda: mlp.MLP(hidden=64, n_blocks=3)]))[1]
    assert problem.code == "TP503"
    (problem,) = disagreements(_states([plan, plan], [mlp.tiny, lambda: mlp.MLP(hidden=64)]))[1]
    assert "the ranks built different models: 'blocks.0.in_proj' has weight (128, 32) float32, bias (128,) float32 on rank 0 " \
        "but weight (64, 32) float32, bias (64,) float32 on rank 1;" in problem.message
    (problem,) = disagreements(_states([plan, plan], [mlp.tiny, lambda: mlp.MLP(n_blocks=3)]))[1]
    assert problem.code == "TP503"
    assert problem.message.startswith(
        "the ranks built different models: module 'blocks.2' (MLPBlock) only on rank 1; "
        "module 'blocks.2.in_proj' (Linear) only on rank 1; module 'blocks.2.act' (GELU) only on rank 1; "
        "module 'blocks.2.out_proj' (Linear) only on rank 1; the factory must build the same model on every rank"
    )


def test_hosts_are_named_when_the_ranks_span_nodes():
    tp, sp = load_plan(PLANS / "llama_tp.yaml"), load_plan(PLANS / "llama_tp_sp.yaml")
    (problem,) = disagreements(_states([tp, tp, sp, sp], hosts=["node-a", "node-a", "node-b", "node-b"]))[1]
    assert "ranks 0, 1 on node-a" in problem.message and "ranks 2, 3 on node-b" in problem.message


def test_an_error_on_some_ranks_stops_all_and_says_where():
    plan = load_plan(PLANS / "llama_tp.yaml")
    states = _states([plan, plan])
    states[1]["problems"] = [{"code": "TP001", "severity": "error", "message": "cannot read the plan: No such file or directory", "file": "p.yaml", "line": 1, "column": 1}]
    usage, problems = disagreements(states)
    assert usage == []
    assert [str(p) for p in problems] == ["p.yaml:1:1: TP001 on rank 1: cannot read the plan: No such file or directory"]


def test_a_usage_error_on_any_rank_is_a_usage_error_for_all():
    plan = load_plan(PLANS / "llama_tp.yaml")
    states = _states([plan, plan])
    states[0]["usage"] = states[1]["usage"] = "--tp (3) must divide the world size (2)"
    assert disagreements(states) == (["--tp (3) must divide the world size (2)"], [])
    states[0]["usage"] = None
    assert disagreements(states) == (["rank 1: --tp (3) must divide the world size (2)"], [])


# -- located application and layouts ----------------------------------------------------


def test_a_style_that_cannot_apply_is_tp501_at_its_rule():
    plan = load_plan(text="version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.act: colwise\n", file="p.yaml")
    with simulated_world(2):
        with pytest.raises(PlanError) as caught:
            apply_located(plan, mlp.tiny(), tp_mesh(2))
    (problem,) = caught.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP501", 4, 3)
    assert problem.message.startswith("colwise cannot shard 'blocks.1.act' (GELU) at TP 2: ColwiseParallel currently only support nn.Linear and nn.Embedding")


def test_progress_reports_every_module_descendants_first():
    seen = []
    with simulated_world(2), torch.device("meta"):
        apply_located(load_plan(PLANS / "mlp_tp.yaml"), mlp.tiny(), tp_mesh(2), lambda done, total, fqn: seen.append((done, total, fqn)))
    assert seen == [(1, 4, "blocks.1.out_proj"), (2, 4, "blocks.1.in_proj"), (3, 4, "blocks.0.out_proj"), (4, 4, "blocks.0.in_proj")]


def test_layouts_give_what_each_rank_really_holds_even_when_uneven():
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor

    plan = load_plan(PLANS / "llama_tp.yaml")
    with simulated_world(3), LocalTensorMode(3):
        model = llama.tiny()
        apply_located(plan, model, tp_mesh(3))
        layouts = {layout.name: layout for layout in param_layouts(model, 3)}
        # Under LocalTensorMode every tensor, DTensor shard or not, keeps one real value per rank.
        local = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in model.named_parameters()}
        held = {name: tuple(tuple(t.shape) for _, t in sorted(t._local_tensors.items())) for name, t in local.items()}
    assert {name: layout.local_shapes for name, layout in layouts.items()} == held
    wq = layouts["layers.0.attention.wq.weight"]
    assert (wq.global_shape, wq.local_shapes, wq.placements, wq.uneven) == ((128, 128), ((43, 128), (43, 128), (42, 128)), "shard(0)", True)
    norm = layouts["layers.0.attention_norm.weight"]
    assert (norm.placements, norm.local_shapes) == ("-", ((128,),) * 3)


# -- the parity comparison and SGD steps -------------------------------------------------


def test_comparison_passes_equal_runs_and_names_what_differs():
    torch.manual_seed(0)
    model, inputs = mlp.tiny(), (torch.randn(2, 4, 32),)
    reference = mlp.tiny()  # other weights: the comparison loads the model's into it
    output = model(*inputs)
    output.pow(2).mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    result = compare_with_reference(model, reference, inputs, output, grads)
    assert result.passed and result.max_abs_diff < 1e-6, result.problems

    reference.zero_grad(set_to_none=True)
    grads["blocks.1.out_proj.bias"] = None
    result = compare_with_reference(model, reference, inputs, output.detach() + 0.5, grads)
    assert not result.passed
    assert result.problems[0].startswith("output 0 differs by up to 0.5 (allowed ")
    assert result.problems[1] == "blocks.1.out_proj.bias grad is missing"


def test_sgd_steps_lower_the_loss_towards_fixed_targets():
    torch.manual_seed(0)
    result = sgd_steps(mlp.tiny(), (torch.randn(4, 8, 32),), 5, torch.device("cpu"), seed=0)
    assert len(result.losses) == len(result.step_times_s) == 5
    assert result.losses[-1] < result.losses[0]
    assert result.median_step_s == sorted(result.step_times_s)[2]


def test_the_cli_still_starts_without_torch():
    # `apply` is registered on the app at start-up; its module must not pull torch in.
    code = "import sys, tpplan.cli.app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
