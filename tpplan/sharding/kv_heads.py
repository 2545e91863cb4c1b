"""`HeadsColwiseParallel` (a plan's `{style: colwise, heads: auto}`): a
column-parallel projection whose output is whole heads (a GQA model's k_proj /
v_proj), that keeps working when the TP degree exceeds the head count by
replicating heads.

- otherwise (degree <= heads, or not a multiple of them, or the query
  projection): exactly torch's `ColwiseParallel`.
- degree > heads, a multiple of them: rank r holds head r // (degree / heads),
  whole. The weight is a DTensor on the 2-D view (heads, replicas) of the TP mesh,
  `(Shard(0), Replicate())`; each replica computes its head for its own query
  heads, so the weight's gradient is partial over the replicas (summed there,
  like a norm weight's under sequence parallelism) and the input's gradient
  partial over the whole mesh (all-reduced, like any colwise input's).

Attention code must repeat KV heads by the LOCAL ratio (query heads on the rank /
KV heads on the rank): given the attention module (`bind_parent`, which
`tpplan.plan.Plan.apply` calls before applying), the style sets transformers'
`num_key_value_groups` on it (the one model attribute it changes: the attention's
own forward repeats by it), and reads the head count from its head size (its or its
config's, core/head_counts.py: the lint's reader) when `heads` is not given. Code that derives the ratio from tensor shapes
(tpplan.models.llama) needs nothing more. The style's own state (the mesh, the
parent) is on the style object, one per module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from ..core.head_counts import HEAD_ATTRS, HEAD_DIM_ATTRS, head_counts, head_dim_of
from ..core.problems import StyleInputError

__all__ = ["HeadsColwiseParallel", "replicas"]


def replicas(heads: int, degree: int) -> int:
    """How many ranks hold each head at `degree`: 1 unless the degree is a multiple of `heads` above it."""
    return degree // heads if degree > heads and degree % heads == 0 else 1


def _query_heads(parent: nn.Module | None) -> int | None:
    """The attention's query-head count, where it or its config says (core/head_counts.py, as the lint reads it)."""
    found = head_counts(parent) if parent is not None else None
    return found.query if found is not None else None


def _heads_mesh(mesh: DeviceMesh, heads: int, copies: int) -> DeviceMesh:
    """The TP mesh viewed as (heads, replicas): rank r at (r // copies, r % copies). Built
    outside any fake-tensor mode (a dry run's): the mesh's rank tensor must be real."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # torch 2.13 has no public way to view a mesh's dim as two: `DeviceMesh(rank
    # tensor)` and `DeviceMesh.from_group` need process groups for every (heads,
    # replicas) slice, made by every rank of the world in one order, which is what
    # `_unflatten` does over the root mesh (torchtitan's ParallelDims uses it too).
    with unset_fake_temporarily():
        return mesh._unflatten(0, (heads, copies), ("kv_heads", "kv_replicas"))


class HeadsColwiseParallel(ParallelStyle):
    """Column-parallel over whole heads; heads replicated when the degree is a multiple of
    their count above it (the query projection is never replicated: plain colwise).

    Keyword Args:
        heads (int, optional): number of heads in the projection's output; default
            out_features / the attention module's head size (see `bind_parent`).
        input_layouts (Placement, optional): layout of the input. Default Replicate.
        use_local_output (bool, optional): return a local tensor (always, when heads
            are replicated: the output is not a shard of any DTensor). Default True.
    """

    def __init__(self, *, heads: int | None = None, input_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__()
        if heads is not None and heads < 1:
            raise StyleInputError(f"colwise with heads: heads is {heads}", "give the projection's head count (at least 1), or heads: auto")
        self.heads = heads
        self._parent: nn.Module | None = None
        self.mesh: DeviceMesh | None = None  # set by _apply
        self.input_layouts = input_layouts or Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise StyleInputError(
                f"colwise with heads shards an nn.Linear's output heads; {type(module).__name__} is not one",
                "put the rule on the attention's q/k/v projections, or drop heads: for plain colwise",
            )
        heads = self._heads(module)
        degree = device_mesh.size()
        copies = replicas(heads, degree)
        if copies > 1 and heads == _query_heads(self._parent):
            copies = 1  # query heads are never replicated (o_proj needs them split): torch's colwise decides
        if copies == 1:
            colwise = ColwiseParallel(input_layouts=self.input_layouts, use_local_output=self.use_local_output)
            colwise.src_data_rank = self.src_data_rank
            return colwise._apply(module, device_mesh)
        if self._parent is not None:
            self._adjust_parent(self._parent, heads, degree)
        heads_mesh = _heads_mesh(device_mesh, heads, copies)
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, heads_mesh, [Shard(0), Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        self.mesh = device_mesh
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        return module

    def _pre_forward(self, module: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise StyleInputError(
                f"colwise with heads on {type(module).__name__} needs a tensor as its first positional input, "
                f"got {type(args[0]).__name__ if args else 'none'}",
                "put the rule on a projection the model calls with its hidden states",
            )
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, (self.input_layouts,), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        for name, param in module.named_parameters(recurse=False):
            module.__dict__[name] = param.to_local(grad_placements=(Shard(0), Partial()))
        return (x.to_local(grad_placements=(Partial(),)), *args[1:])

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        for name, _ in module.named_parameters(recurse=False):
            module.__dict__.pop(name, None)
        return output

    def bind_parent(self, parent: nn.Module) -> None:
        """The attention module that holds this projection (before `_apply`)."""
        self._parent = parent

    def _heads(self, module: nn.Module) -> int:
        heads = self.heads
        if heads is None:
            head_dim = head_dim_of(self._parent) if self._parent is not None else None
            if head_dim is None:
                parent = type(self._parent).__name__ if self._parent is not None else "no parent module"
                raise StyleInputError(
                    f"colwise with heads: auto reads the head size from the attention module or its config "
                    f"({', '.join(HEAD_DIM_ATTRS)}, or the hidden size over the query heads); {parent} has none",
                    "give the head count (heads: N)",
                )
            heads = module.out_features // head_dim
        if heads < 1 or module.out_features % heads:
            raise StyleInputError(
                f"colwise with heads: the {module.out_features} output features of {type(module).__name__} are not {heads} whole heads",
                "give the projection's head count (heads: N), which divides its out_features",
            )
        return heads

    @staticmethod
    def _adjust_parent(parent: nn.Module, heads: int, degree: int) -> None:
        """Make transformers' attention repeat KV heads by the local ratio: each rank holds
        one KV head and n_q / degree query heads. Its forward repeats by
        `num_key_value_groups`, so the style sets it (the k and v projections' styles
        alike: from the query-head count, not from the value it may have set already)."""
        groups = getattr(parent, "num_key_value_groups", None)
        if not isinstance(groups, int):
            return  # the attention derives the ratio from shapes (tpplan.models.llama)
        query_heads = _query_heads(parent)
        if query_heads is None:
            raise StyleInputError(
                f"colwise with heads replicates {heads} KV heads over TP degree {degree}, so {type(parent).__name__}'s "
                "num_key_value_groups must become the local ratio, but neither it nor its config gives a query-head count "
                f"({', '.join(HEAD_ATTRS)})",
                f"use a TP degree that divides the {heads} KV heads",
            )
        if query_heads % degree:
            raise StyleInputError(
                f"{query_heads} query heads of {type(parent).__name__} do not divide over TP degree {degree}",
                f"use a TP degree that divides {query_heads}",
            )
        parent.num_key_value_groups = query_heads // degree

    def __repr__(self) -> str:
        return f"HeadsColwiseParallel(heads={self.heads}, input_layouts={self.input_layouts!r}, use_local_output={self.use_local_output})"
