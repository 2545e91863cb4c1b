"""The glue spmd_types (Meta's SPMD type checker, 0.3.1) needs to check a tpplan plan.

The plan is applied as `tpplan apply` does (torch's ParallelStyles on DTensor,
torch's fake process group); spmd_types then types every local tensor from the
DTensor boundaries itself: `to_local()` gives S -> V, Partial -> P, Replicate ->
I (or R when the gradient is declared Partial, as `sum_output_grad` does), and
`from_local()` asserts the tensor it wraps has the type its placements say. What
is left for the glue is what no boundary types: the model's inputs and its plain
(non-DTensor) parameters, typed I (the same on every rank, their gradients
complete, as an optimizer steps them) or, for those a rule holds as plain local
shards (local_params' and the expert styles' `params`), V (P for partial); and its
buffers, typed I, or R for a buffer the forward accumulates into from R values
(spmd_types refuses an in-place I -> R, which is sound for a no-grad buffer: found
by one rerun). Then one forward and the loss's backward under `typecheck()`
(strict). A placement its DTensor bridge does not know (`_StridedShard`, tpplan's
packed_shard) is its "no-rule" too.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

import spmd_types as spmd
import spmd_types.checker  # noqa: F401  (registers the DTensor boundary checks)
from spmd_types import _checker

from tpplan.simulation.modelref import build_model, make_inputs
from tpplan.simulation.simulate import scalar_loss, simulated_world, tp_mesh

# the local ops spmd_types types by a rule of its own; any other gets its default
# (non-linear: R, I, V pass through, a partial sum is refused)
_RULED = (set(_checker._OP_REGISTRY) | set(_checker._DECOMP_TYPE_RULES) | _checker._DETERMINISTIC_FACTORIES
          | _checker._DETERMINISTIC_NEW_FACTORIES)
_UNREGISTERED = "is not registered for SPMD type"  # strict mode's refusal of an autograd Function it has no rule for
_UNKNOWN_PLACEMENT = "Unknown DTensor placement"  # its DTensor bridge on a placement it has no type for
_BUFFER_RETYPE = re.compile(r"in-place/out operation would change SPMD type on axis \S+ from \S*\.I to \S*\.R")


@dataclass
class SpmdResult:
    verdict: str  # "clean", "error" (a type error), "no-rule" (an autograd Function or a placement it cannot type)
    message: str = ""
    default_ops: set[str] = field(default_factory=set)  # local ops typed by the default rule
    seconds: float = 0.0  # the checked forward and backward


class _Recorder:
    """Wraps the checker's typing of a local op (its `_typecheck_torch_op`, the one place
    every non-DTensor op is typed) for the run: the ops it types by its default rule, and
    the tensor an op it refused would have written to (a buffer to retype)."""

    def __init__(self) -> None:
        self.default_ops: set[str] = set()
        self.refused_target: object = None
        self._orig = _checker._SpmdTypeMode._typecheck_torch_op

    def __enter__(self) -> "_Recorder":
        recorder = self

        def typed(mode, func, result, args, *rest, **kwargs):
            if func not in _RULED:
                recorder.default_ops.add(getattr(func, "__name__", repr(func)))
            try:
                return recorder._orig(mode, func, result, args, *rest, **kwargs)
            except spmd.SpmdTypeError:
                recorder.refused_target = args[0] if args else None
                raise

        _checker._SpmdTypeMode._typecheck_torch_op = typed
        return self

    def __exit__(self, *exc) -> None:
        _checker._SpmdTypeMode._typecheck_torch_op = self._orig


def _typed_run(plan, model_ref: str, tp: int, as_r: set[str], seed: int) -> tuple[SpmdResult, str | None]:
    """One checked forward and backward; the name of a buffer to retype R, if that is the refusal."""
    with simulated_world(tp):
        torch.manual_seed(seed)
        model = build_model(model_ref, "cpu")
        inputs = make_inputs(None, model, "cpu")
        mesh = tp_mesh(tp, plan.mesh_axis)
        local = _local_param_types(plan, model)
        plan.apply(model, mesh)
        axis = mesh.get_group(0)
        buffers = dict(model.named_buffers())
        for name, tensor in buffers.items():
            if not isinstance(tensor, DTensor):
                spmd.assert_type(tensor, {axis: spmd.R if name in as_r else spmd.I})
        for name, tensor in [*model.named_parameters(), *(("", x) for x in inputs)]:
            if not isinstance(tensor, DTensor):
                spmd.assert_type(tensor, {axis: local.get(name, spmd.I)})
        recorder = _Recorder()
        start = time.perf_counter()
        try:
            with recorder, spmd.set_current_mesh(mesh), spmd.checker.typecheck(strict_mode="strict"):
                loss = scalar_loss(model(*inputs))
                if not isinstance(loss, DTensor):  # checked: only an I or P loss gives each rank its right gradient
                    loss.backward()
            if isinstance(loss, DTensor):  # a loss taken in DTensor land (loss_parallel's sharded logits): DTensor's own
                loss.backward()
        except ValueError as exc:
            if not str(exc).startswith(_UNKNOWN_PLACEMENT):
                raise
            return SpmdResult("no-rule", _text(exc), recorder.default_ops, time.perf_counter() - start), None
        except spmd.SpmdTypeError as exc:
            result = SpmdResult("no-rule" if _UNREGISTERED in str(exc) else "error", _text(exc), recorder.default_ops,
                                time.perf_counter() - start)
            retype = next((n for n, b in buffers.items() if b is recorder.refused_target), None) \
                if _BUFFER_RETYPE.search(str(exc)) else None
            return result, retype
        return SpmdResult("clean", "", recorder.default_ops, time.perf_counter() - start), None


def _local_param_types(plan, model) -> dict:
    """{parameter name: V or P} of the parameters a rule leaves plain but holds as local
    shards or partial sums (local_params' and expert styles' `params`): no DTensor says so."""
    kinds = {"shard": spmd.V, "partial": spmd.P, "replicate": spmd.I}
    return {f"{fqn}.{name}" if fqn else name: kinds[placement.kind]
            for fqn, rule in plan.match(model).items() for name, placement in rule.spec.local_param_placements().items()}


def typecheck_plan(plan, model_ref: str, tp: int, seed: int = 0) -> SpmdResult:
    """spmd_types' verdict on `plan` (a loaded tpplan Plan) applied to `model_ref` at `tp`."""
    as_r: set[str] = set()
    while True:
        result, retype = _typed_run(plan, model_ref, tp, as_r, seed)
        if retype is None or retype in as_r:
            return result
        as_r.add(retype)


def _text(exc: BaseException) -> str:
    """The error's first line and the op it names (spmd_types prints the operands after it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    op = next((line for line in lines if line.startswith("In ")), "")
    return f"{lines[0][:300]}" + (f" [{op.rstrip('(')}]" if op else "")
