"""TP323: a DTensor meets a plain tensor."""

from __future__ import annotations

from ..registry import Finding, LintRule
from ..text import styled


def check(ctx):
    if ctx.flow is None:
        return
    for mixed in ctx.flow.mixed:
        src = mixed.value.src
        origin = f"{styled(src.fqn, src.rule)} hands on a DTensor" if src else "a DTensor"
        option = src.rule.spec.local_option() if src is not None else "use_local_output"
        at = ctx.at(src.rule) if src else ctx.plan_location()
        inside = f" inside '{mixed.fqn}'" if mixed.fqn and not mixed.detail.startswith("module") else ""
        yield Finding(at, (
            f"{origin} ({mixed.value.text(len(mixed.shape))}) that meets {mixed.detail}{inside}: "
            f"torch raises 'mixed torch.Tensor and DTensor'; set {option}: true on that rule, or give what it meets "
            "a style of its own"
        ))


RULE = LintRule(
    code="TP323",
    name="mixed-dtensor",
    severity="error",
    summary="A DTensor (use_local_output: false) meets a plain tensor.",
    what="""
        Follows the DTensors that styles return when `use_local_output` is false
        (and that `sequence_parallel` and `prepare_module_input` return by
        default) and reports the first op or unplanned module with parameters
        where one meets a plain tensor that is not a scalar.
    """,
    why="""
        DTensor ops refuse plain tensor operands (`aten.mul.Tensor: got mixed
        torch.Tensor and DTensor`), so the forward fails at that op. It is
        usually one sibling set differently from the others (w1 returning a
        DTensor, w3 a local tensor) or a residual add that meets the DTensor.
    """,
    failing="""
        version: 1
        rules:
          layers.*.feed_forward.w1: {style: colwise, use_local_output: false}
          layers.*.feed_forward.w3: colwise
          layers.*.feed_forward.w2: rowwise
    """,
    passing="""
        version: 1
        rules:
          layers.*.feed_forward:
            style: prepare_module_input
            input_layouts: replicate
            desired_input_layouts: replicate
            use_local_output: false
          layers.*.feed_forward.w{1,3}: colwise
          layers.*.feed_forward.w2: rowwise
    """,
    check=check,
)
