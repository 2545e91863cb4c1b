"""DTensor sharding rules of the target device (CUDA) for ops that have another
form on the simulating CPU.

A simulation runs on CPU, but the plan is for a CUDA cluster. Some ops take a
device-specific form: `F.scaled_dot_product_attention` on DTensor q/k/v reaches
`aten._scaled_dot_product_flash_attention` (or the efficient / cuDNN form) on
CUDA, each with a DTensor sharding rule in torch, but
`aten._scaled_dot_product_flash_attention_for_cpu` on CPU, which has none; a
plan that runs on the cluster (torchtitan's Qwen3 plan, whose q/k/v stay
DTensors) would fail only here. Inside `cuda_rules()` the CPU forms get the
rules of their CUDA forms, so the simulation decides what the cluster decides.

Ops given device-faithful rules (CPU form <- the CUDA rule it mirrors):

- `aten._scaled_dot_product_flash_attention_for_cpu` <- the flash / efficient
  attention forward: q/k/v sharded on heads (dim 1) or on the batch (dim 0), or
  all replicated; `attn_mask` (the efficient form's `attn_bias` on CUDA) laid
  out like q; outputs `(out, logsumexp)` laid out like q.
- `aten._scaled_dot_product_flash_attention_for_cpu_backward` <- the flash /
  efficient attention backward: `(grad_q, grad_k, grad_v)` from `grad_out`,
  q, k, v, `out`, `logsumexp` (and `attn_mask`), all on heads, all on the
  batch, or all replicated.

An op with no rule on CUDA either is left without one: the failure is real on
the cluster and is reported as TP507 (`locate.no_rule_problem`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

aten = torch.ops.aten

# The strategies of one mesh dim: placements of [outputs..., tensor inputs...]
# (the tensor inputs in schema order, kwargs last, as expand_to_full_mesh_op_strategy reads them).


def _forward_strategy(op_schema):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    # (out, logsumexp) <- (q, k, v[, attn_mask]); the CUDA flash rule without its
    # cum_seq / max / rng / debug-mask outputs, which the CPU form does not return
    has_mask = isinstance(op_schema.kwargs_schema.get("attn_mask"), OpStrategy)
    tensors = 2 + 3 + has_mask
    strategies = [[placement] * tensors for placement in (Replicate(), Shard(1), Shard(0))]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, strategies, input_index=2)


def _backward_strategy(op_schema):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    # (grad_q, grad_k, grad_v) <- (grad_out, q, k, v, out, logsumexp[, attn_mask]);
    # the CPU backward returns no gradient for the mask
    has_mask = isinstance(op_schema.kwargs_schema.get("attn_mask"), OpStrategy)
    tensors = 3 + 6 + has_mask
    strategies = [[placement] * tensors for placement in (Replicate(), Shard(1), Shard(0))]
    mesh = op_schema.get_mesh_from_args(validate=False)  # the forward validated it, as torch's backward rules assume
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)


def _rules() -> dict:
    """{op: (strategy, schema_info)}: the non-tensor arguments from dropout_p on
    (and `scale`) are part of the sharding cache key, as in torch's own rules."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: (_forward_strategy, RuntimeSchemaInfo(3, static_kwargkey=["scale"])),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (_backward_strategy, RuntimeSchemaInfo(6, static_kwargkey=["scale"])),
    }


def faithful_ops() -> list[str]:
    """The names of the ops `cuda_rules()` gives rules to."""
    return [str(op) for op in _rules()]


@contextlib.contextmanager
def cuda_rules() -> Iterator[None]:
    """Give the CPU forms their CUDA rules for the body, and restore DTensor's
    own rules (none, or what another caller registered) on exit. Reentrant."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    saved = {op: (propagator.op_strategy_funcs.get(op), propagator.op_to_schema_info.get(op)) for op in _rules()}
    for op, (strategy, schema_info) in _rules().items():
        propagator.register_op_strategy(op, strategy, schema_info)
    try:
        yield
    finally:
        for op, (strategy, schema_info) in saved.items():
            _restore(propagator.op_strategy_funcs, op, strategy)
            _restore(propagator.op_to_schema_info, op, schema_info)
        propagator.propagate_op_sharding.cache_clear()  # a cached result of the rule would outlive it


def _restore(table: dict, op, value) -> None:
    if value is None:
        table.pop(op, None)
    else:
        table[op] = value
