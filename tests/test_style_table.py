"""The style table is the one source of what a style does: no module outside it
branches on a style's name, its per-module parameter placements are what the
compiled styles do, and the one local-shape function is torch's own cut."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tpplan.core.placements import PlacementSpec
from tpplan.core.schema import STYLE_NAMES, STYLE_SPECS

PACKAGE = Path(__file__).resolve().parent.parent / "tpplan"
# The style table itself: the one place a style's name may decide anything.
STYLE_TABLE = {"core/style_table.py", "core/expert_styles.py", "core/style_model.py"}


def _literals(node: ast.AST) -> set[str]:
    """The string constants `node` is, or holds as a tuple/list/set display."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def style_name_branches(source: str, names: set[str]) -> list[tuple[int, int, str]]:
    """(line, col, code) of each comparison of something with a style-name literal
    (`x == "colwise"`, `x in ("expert_tp", "expert_parallel")`, or `x in NAMES` for a
    module-level display of such literals) and each `case "colwise":`. A comparison
    with transformers' own tp_plan words (an operand naming `hf_style`) is not one:
    transformers' vocabulary shares some words with tpplan's."""
    tree = ast.parse(source)
    named = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and _literals(node.value) & names
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any("hf_style" in ast.unparse(op) for op in operands):
                continue
            if any(_literals(op) & names or (isinstance(op, ast.Name) and op.id in named) for op in operands):
                found.append((node.lineno, node.col_offset, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and _literals(node.value) & names:
            found.append((node.lineno, node.col_offset, f"case {ast.unparse(node.value)}"))
    return found


def test_no_module_outside_the_style_table_branches_on_a_style_name():
    branches = {
        f"{path.relative_to(PACKAGE)}:{line}:{col}": code
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in STYLE_TABLE
        for line, col, code in style_name_branches(path.read_text(encoding="utf-8"), set(STYLE_NAMES))
    }
    assert branches == {}


def test_the_branch_finder_sees_each_way_of_testing_a_style_name():
    source = '''
EXPERT_STYLES = ("expert_tp", "expert_parallel")
if rule.spec.style == "local_params":
    pass
if style not in ("expert_tp", "expert_parallel"):
    pass
if style in EXPERT_STYLES:
    pass
match style:
    case "colwise":
        pass
if s.hf_style == "local_params" or kind == "Linear":
    pass
'''
    found = style_name_branches(source, set(STYLE_NAMES))
    assert [(line, code) for line, _, code in found] == [
        (3, "rule.spec.style == 'local_params'"),
        (5, "style not in ('expert_tp', 'expert_parallel')"),
        (7, "style in EXPERT_STYLES"),
        (10, "case 'colwise'"),
    ]


def test_the_style_table_has_one_placement_text():
    defined = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef) and node.name == "placement_text"
    )
    assert defined == ["core/placements.py"]


# -- parameter placements from the table ---------------------------------------------------


def _experts(transposed: bool = False, bias: bool = True, experts: int = 4) -> torch.nn.Module:
    module = torch.nn.Module()
    e, h, i = experts, 6, 8
    module.gate_up_proj = torch.nn.Parameter(torch.randn(e, h, 2 * i) if transposed else torch.randn(e, 2 * i, h))
    module.down_proj = torch.nn.Parameter(torch.randn(e, i, h) if transposed else torch.randn(e, h, i))
    if bias:
        module.gate_up_proj_bias = torch.nn.Parameter(torch.randn(e, 2 * i))
        module.down_proj_bias = torch.nn.Parameter(torch.randn(e, h))
    return module


def _stacked_linears() -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_experts, module.output_size, module.input_size = 2, 7, 5
    module.weight = torch.nn.Parameter(torch.randn(2, 7, 5))
    return module


def _conv1d() -> torch.nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(7, 5)  # weight [5, 7]


# (rule, module, TP degree): sizes the degree does not divide where the style allows an
# uneven shard (torch's chunks); a packed shard (expert_tp's gate/up) must split evenly.
_PLACED = [
    *((rule, make, 3) for rule in ("colwise", "rowwise")
      for make in (lambda: torch.nn.Linear(5, 7), lambda: torch.nn.Embedding(7, 5), _conv1d, _stacked_linears)),
    ("sequence_parallel", lambda: torch.nn.LayerNorm(5), 3),
    ("no_parallel", lambda: torch.nn.Linear(5, 7), 3),
    *(({"style": "expert_tp", **more}, lambda t=transposed: _experts(t), 2)
      for more in ({}, {"params": {"down_proj_bias": "shard(1)"}}) for transposed in (False, True)),
    ({"style": "expert_parallel"}, lambda: _experts(experts=3), 3),
    ({"style": "local_params", "params": {"down_proj": "shard(0)"}}, lambda: _experts(experts=5), 3),
]


@pytest.mark.parametrize("rule, make, tp", _PLACED)
def test_the_compiled_style_places_parameters_as_the_contract_says_and_the_shard_math_sees_it(rule, make, tp):
    """Each rank holds what `own_placements` (the rule's contract, or its per-module
    placements) says: the DTensors the compiled style makes, and so the per-rank shapes
    and bytes that checkpoint inspection and the dry run's parameter table report."""
    from tpplan.checkpoint.inspect import expected_tensors
    from tpplan.core.local_shapes import shapes_on_mesh
    from tpplan.core.schema import rule_spec
    from tpplan.runtime.layouts import param_layouts
    from tpplan.runtime.simulate import simulated_world, tp_mesh
    from tpplan.sharding.compile import compile_for
    from tpplan.sharding.styles import module_kind

    spec, module = rule_spec(rule), make()
    expected = spec.own_placements(module, module_kind(module))
    shapes = {name: shapes_on_mesh(tuple(p.shape), (tp,), [expected[name].to_torch()]) for name, p in module.named_parameters()}
    with simulated_world(tp):
        compile_for(spec, module)._apply(module, tp_mesh(tp, "tp"))
    assert {name: p.placements for name, p in module.named_parameters()} == {
        name: (placement.to_torch(),) for name, placement in expected.items()
    }
    assert any(placement.kind != "replicate" for placement in expected.values()) or spec.semantics.contract.tp.subtree
    assert {e.names[0]: tuple(e.local_shapes) for e in expected_tensors(module)} == shapes
    assert {p.name: p.local_shapes for p in param_layouts(module, tp)} == shapes


def test_expert_tp_places_a_transposed_packed_gate_up_on_its_last_dim():
    from tpplan.core.schema import rule_spec

    placed = rule_spec("expert_tp").param_placements(_experts(transposed=True))
    assert placed == {
        "gate_up_proj": PlacementSpec("shard", 2, blocks=2),
        "down_proj": PlacementSpec("shard", 1),
        "gate_up_proj_bias": PlacementSpec("shard", 1, blocks=2),
        "down_proj_bias": PlacementSpec("replicate"),
    }


def test_expert_styles_refuse_a_module_without_the_expert_dim_first():
    from tpplan.core.problems import StyleInputError
    from tpplan.core.schema import rule_spec

    for style in ("expert_tp", "expert_parallel"):
        with pytest.raises(StyleInputError, match=rf"{style} needs a module whose own parameters all have the expert dim first .*Linear has: weight \[2, 2\], bias \[2\]"):
            rule_spec(style).param_placements(torch.nn.Linear(2, 2))
    with pytest.raises(StyleInputError, match="params names no parameter of .*: 'up_proj'"):
        rule_spec({"style": "expert_tp", "params": {"up_proj": "shard(1)"}}).param_placements(_experts())


def test_only_colwise_with_heads_needs_its_parent():
    from tpplan.core.schema import rule_spec

    assert rule_spec({"style": "colwise", "heads": 2}).needs_parent()
    assert [name for name in STYLE_NAMES if STYLE_SPECS[name].model_construct(style=name).needs_parent()] == []


# -- local shapes: torch's cut ----------------------------------------------------------------


def _held(dtensor) -> tuple[tuple[int, ...], ...]:
    """Each rank's local shape, as the DTensor holds it under LocalTensorMode."""
    locals_ = dtensor._local_tensor._local_tensors
    return tuple(tuple(locals_[rank].shape) for rank in sorted(locals_))


@pytest.mark.parametrize("shape, placement, world", [
    ((6, 3), "shard(0)", 4),  # uneven: the last rank holds nothing
    ((10, 4), "shard(0)", 3),  # uneven: 4, 4, 2
    ((5, 7), "shard(-1)", 2),
    ((16, 4), "packed_shard(0, 2)", 4),  # torch's _StridedShard
    ((4, 24), "packed_shard(1, 3)", 4),
    ((4, 5), "replicate", 2),
])
def test_local_shapes_are_what_each_rank_of_a_real_dtensor_holds(shape, placement, world):
    from torch.distributed._local_tensor import LocalTensorMode

    from tpplan.core.local_shapes import local_shapes
    from tpplan.core.placements import parse_placement
    from tpplan.runtime.simulate import simulated_world, tp_mesh
    from tpplan.sharding.experts import distribute_param

    with simulated_world(world), LocalTensorMode(world):
        dtensor = distribute_param(torch.randn(shape), tp_mesh(world, "tp"), parse_placement(placement).to_torch(), 0)
        assert local_shapes(dtensor) == _held(dtensor)
    assert local_shapes(torch.randn(shape)) == (shape,)


def test_local_shapes_of_a_2d_mesh_list_its_ranks_in_order():
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tpplan.core.local_shapes import local_shapes
    from tpplan.runtime.simulate import simulated_world

    with simulated_world(4), LocalTensorMode(4):
        dtensor = distribute_tensor(torch.randn(5, 3), init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])
        assert local_shapes(dtensor) == _held(dtensor) == ((3, 2), (3, 1), (2, 2), (2, 1))


def test_the_report_the_checkpoint_inspector_and_the_lint_use_the_one_local_shape_function():
    from tpplan.checkpoint import inspect
    from tpplan.core import local_shapes
    from tpplan.lint import text
    from tpplan.runtime import layouts

    assert inspect.local_shapes is local_shapes.local_shapes
    assert layouts.mesh_local_shapes is local_shapes.local_shapes
    assert text.shapes_on_mesh is local_shapes.shapes_on_mesh
    assert layouts.local_shapes(torch.randn(3, 2), 4) == ((3, 2),) * 4
    assert (text.chunk_sizes(10, 4), text.chunk_sizes(6, 4)) == ([3, 3, 3, 1], [2, 2, 2, 0])
