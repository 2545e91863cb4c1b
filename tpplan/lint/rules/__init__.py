"""The lint rules, one module each; importing this package registers them all."""

from . import (  # noqa: F401  (imported to register)
    arity,
    coverage,
    dry_run,
    head_divisibility,
    loss_parallel_head,
    layout_mismatch,
    mixed_dtensor,
    sequence_parallel_nested,
    sequence_parallel_open,
    sequence_parallel_positionwise,
    shard_divisibility,
    shard_leak,
    shared_input_comms,
    style_module,
    tied_placement,
    trace_unavailable,
    uneven_handoff,
    unused_layout,
)
