"""The lint rules, one module each, listed here explicitly (as yamllint's `_RULES`):
`RULES` is the registry `lint_model`, `tpplan rules` and docs/rules.md read.
Adding a rule: write its module, add its `RULE` below.

Importing this package does not import torch: `tpplan rules` stays fast.
"""

from ..registry import rule_table
from . import (
    arity,
    coverage,
    dry_run,
    expert_divisibility,
    fused_projection,
    head_divisibility,
    layout_mismatch,
    loss_parallel_head,
    mixed_dtensor,
    opaque_style,
    replicated_partial_grad,
    sequence_parallel_nested,
    sequence_parallel_open,
    sequence_parallel_positionwise,
    shard_divisibility,
    shard_leak,
    shared_input_comms,
    style_class,
    style_module,
    tied_placement,
    trace_unavailable,
    uneven_handoff,
    unmodelled_op,
    unshared_grad_sum,
    unused_layout,
)

# code -> rule, in code order
RULES = rule_table([
    style_module.RULE,  # TP300
    sequence_parallel_nested.RULE,  # TP301
    sequence_parallel_positionwise.RULE,  # TP302
    arity.RULE,  # TP303
    unused_layout.RULE,  # TP304
    expert_divisibility.RULE,  # TP305
    style_class.RULE,  # TP306
    opaque_style.RULE,  # TP307
    shard_divisibility.RULE,  # TP310
    head_divisibility.RULE,  # TP311
    layout_mismatch.RULE,  # TP320
    shard_leak.RULE,  # TP321
    sequence_parallel_open.RULE,  # TP322
    mixed_dtensor.RULE,  # TP323
    uneven_handoff.RULE,  # TP324
    replicated_partial_grad.RULE,  # TP325
    fused_projection.RULE,  # TP326
    unshared_grad_sum.RULE,  # TP327
    unmodelled_op.RULE,  # TP328
    trace_unavailable.RULE,  # TP329
    dry_run.RULE,  # TP330
    shared_input_comms.RULE,  # TP340
    tied_placement.RULE,  # TP350
    coverage.RULE,  # TP360
    loss_parallel_head.RULE,  # TP370
])
