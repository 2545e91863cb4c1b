"""Where the heads are for a per-head norm (transformers' `replicated_with_grad_allreduce`
on q_norm/k_norm): Qwen3 normalizes [batch, seq, heads, head_dim] (heads at dim -2),
Apertus and EXAONE 4 normalize after the transpose, [batch, heads, seq, head_dim]
(heads at dim 1). The colwise q/k projections shard the heads, so the norm's
local_params rule declares the dim they are on; a wrong one is TP320 (and only
works by accident: the norm is elementwise over head_dim).

Found by one forward of the model on fake tensors (no memory) with a sequence
length no head count equals, recording each norm's input shape.
"""

from __future__ import annotations

from typing import Any

from ..core.quiet import loggers_quiet

_SEQ = 5  # no head count of a real config is 5: the dim of size 5 is the sequence


def heads_dims(config, model_cls, fqns: list[str]) -> dict[str, int]:
    """{module path: the dim of its first input that holds the heads} for each of `fqns`
    whose input is [batch, seq, heads, head_dim] (-2) or [batch, heads, seq, head_dim] (1)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .grouped_mm import accept_real_dtypes

    accept_real_dtypes()  # MoE experts' float32 grouped_mm on fake tensors
    shapes: dict[str, tuple[int, ...]] = {}
    # as simulation.simulate.fake_tensors (hf sits below the simulation)
    with _fake_kernel_logs_off(), FakeTensorMode(allow_non_fake_inputs=True):
        model = model_cls(config)
        modules = dict(model.named_modules())
        for fqn in fqns:
            def hook(_module, args, fqn=fqn):
                if args and isinstance(args[0], torch.Tensor):
                    shapes.setdefault(fqn, tuple(args[0].shape))
            modules[fqn].register_forward_pre_hook(hook)
        vocab = getattr(config, "vocab_size", None) or 2
        model(torch.randint(0, vocab, (1, _SEQ)))
    found = {}
    for fqn, shape in shapes.items():
        if len(shape) == 4 and shape[2] == _SEQ and shape[1] != _SEQ:
            found[fqn] = 1
        elif len(shape) == 4 and shape[1] == _SEQ:
            found[fqn] = -2
    return found


def _fake_kernel_logs_off():
    """torch logs a traceback for each fake kernel that fails even when the model's
    code catches it and falls back: noise on a run that succeeds."""
    return loggers_quiet("torch._subclasses.fake_tensor")


def with_heads_dim(value: Any, dim: int) -> dict[str, Any]:
    """The local_params rule value of a per-head norm (`value`: "local_params" or its
    mapping) declaring the dim its heads are on: its input is this rank's heads as a
    plain tensor (the colwise projection's local output), the declared layout lets
    the lint check it (TP320), and the replicated weight's gradient is summed (TP325)."""
    layout = f"shard({dim})"
    base = {"style": value} if isinstance(value, str) else dict(value)
    return {**base, "input_layouts": layout, "desired_input_layouts": layout, "use_local_output": True}
