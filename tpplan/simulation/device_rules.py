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

Context parallelism (`context_parallel_rules()`, inside `cuda_rules()`'s): torch
shards the sequence through the CUDA kernels alone, with a rule that also allows
q/k/v, out and logsumexp sharded on the sequence (dim 2, `_sharding_rules`) and a
DTensor handler that runs its ring attention on each rank's shards
(`_sdpa_handler`). The CPU forms get both: the rules above plus the sequence, and
a handler that calls torch's own ring (`_templated_ring_attention` and its
backward) with the CPU kernel where the CUDA handler passes the CUDA one. The
ring's loop, its rotation (all-gather or all-to-all), its head-tail schedule and
its merge of partial results are torch's; only the per-block kernel is the CPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..sharding.context_parallel import SEQ_DIM, simulated_on_cpu

aten = torch.ops.aten

# The strategies of one mesh dim: placements of [outputs..., tensor inputs...]
# (the tensor inputs in schema order, kwargs last, as expand_to_full_mesh_op_strategy reads them).


def _placements(sequence: bool) -> list:
    """One placement for every tensor of the op, per strategy: replicated, on heads, on
    the batch, and (context parallelism's rule) on the sequence."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate(), Shard(1), Shard(0)] + ([Shard(SEQ_DIM)] if sequence else [])


def _forward_strategy(op_schema, sequence: bool = False):
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    # (out, logsumexp) <- (q, k, v[, attn_mask]); the CUDA flash rule without its
    # cum_seq / max / rng / debug-mask outputs, which the CPU form does not return
    has_mask = isinstance(op_schema.kwargs_schema.get("attn_mask"), OpStrategy)
    tensors = 2 + 3 + has_mask
    strategies = [[placement] * tensors for placement in _placements(sequence)]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, strategies, input_index=2)


def _backward_strategy(op_schema, sequence: bool = False):
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    # (grad_q, grad_k, grad_v) <- (grad_out, q, k, v, out, logsumexp[, attn_mask]);
    # the CPU backward returns no gradient for the mask
    has_mask = isinstance(op_schema.kwargs_schema.get("attn_mask"), OpStrategy)
    tensors = 3 + 6 + has_mask
    strategies = [[placement] * tensors for placement in _placements(sequence)]
    mesh = op_schema.get_mesh_from_args(validate=False)  # the forward validated it, as torch's backward rules assume
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)


def _rules(sequence: bool = False) -> dict:
    """{op: (strategy, schema_info)}: the non-tensor arguments from dropout_p on
    (and `scale`) are part of the sharding cache key, as in torch's own rules.
    `sequence`: context parallelism's rules (the sequence dim allowed too)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    def forward(op_schema):
        return _forward_strategy(op_schema, sequence)

    def backward(op_schema):
        return _backward_strategy(op_schema, sequence)

    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: (forward, RuntimeSchemaInfo(3, static_kwargkey=["scale"])),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (backward, RuntimeSchemaInfo(6, static_kwargkey=["scale"])),
    }


def faithful_ops() -> list[str]:
    """The names of the ops `cuda_rules()` gives rules to."""
    return [str(op) for op in _rules()]


@contextlib.contextmanager
def cuda_rules(sequence: bool = False) -> Iterator[None]:
    """Give the CPU forms their CUDA rules for the body (`sequence`: context
    parallelism's, see `context_parallel_rules`), and restore DTensor's own rules
    (none, or what another caller registered) on exit. Reentrant."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    saved = {op: (propagator.op_strategy_funcs.get(op), propagator.op_to_schema_info.get(op)) for op in _rules()}
    for op, (strategy, schema_info) in _rules(sequence).items():
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


# -- context parallelism ------------------------------------------------------------------------


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """torch's `_scaled_dot_product_ring_flash_attention` with the CPU kernel: the
    same ring, its blocks computed by `_scaled_dot_product_flash_attention_for_cpu`."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:  # as torch's CUDA ring: its blocks take no mask
        raise NotImplementedError("context parallelism's ring attention takes no attn_mask (torch 2.13): use is_causal=True")
    return _templated_ring_attention(mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
                                     query=query, key=key, value=value, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """torch's `_scaled_dot_product_ring_flash_attention_backward` with the CPU kernel."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward

    return _templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=grad_out,
        grad_out_name="grad_out", query=query, key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal,
        dropout_p=dropout_p, scale=scale)


# The CPU forms torch's ring runs on: {op: whether it is the forward}.
RING_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default: True,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: False}


def _ring_handler(op_call, args, kwargs):
    """torch's `_sdpa_handler` (the DTensor handler of the CUDA kernels under context
    parallelism) for the CPU forms: propagate the sequence rule, run the ring on
    the local shards, wrap the results as the rule lays them out."""
    from torch.distributed.tensor import DTensor, Shard

    placements = args[0].placements  # q (forward) or grad_out (backward)
    if not all(isinstance(p, Shard) and p.dim == SEQ_DIM for p in placements):
        # torch's CUDA handler would run its ring over this mesh anyway: a wrong answer, refused here
        raise RuntimeError(f"context parallelism's ring attention got q/k/v laid out as {placements}, not on the sequence "
                           f"(dim {SEQ_DIM}): with a context_parallel section, every DTensor attention is a ring; give "
                           "this attention local q/k/v (the TP rules' use_local_output), or name it in context_parallel.modules")
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:  # as torch's handler: CP's q/k/v arrive sharded on the sequence
        raise RuntimeError(f"context parallelism: {op_call} got q/k/v that are not all sharded on the sequence of one cp mesh")
    ring = {aten._scaled_dot_product_flash_attention_for_cpu.default: _ring_forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _ring_backward}[op_call]
    return dispatcher.wrap(ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs), sharding.output_spec)


@contextlib.contextmanager
def context_parallel_rules() -> Iterator[None]:
    """Inside the body, DTensor SDPA on CPU runs as context parallelism runs it on
    CUDA: the CPU forms take the sequence rule and torch's ring attention (see the
    module's docstring). What was there before is restored on exit. A simulation
    (one process, threads or the fake process group) applies a plan's
    `context_parallel` inside it; without it a CPU mesh refuses (TP131)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    _clear_sharding_prop_cache()  # a result cached under the rules without the sequence would outlive them
    dispatcher._custom_op_handlers = {**handlers, **dict.fromkeys(_rules(), _ring_handler)}
    try:
        with simulated_on_cpu(), cuda_rules(sequence=True):
            yield
    finally:
        dispatcher._custom_op_handlers = handlers
        _clear_sharding_prop_cache()
