"""Layout flow: follow each tensor of one traced forward through the plan.

Abstract interpretation over a `Trace`. Every tensor gets a layout under the
plan, as torch would give it at run time:

- plain `R`: a local tensor holding the full value (what the model starts with);
- plain `S(d)`: a local tensor holding one rank's shard of dim `d` of the full
  shape (what a style returns with `use_local_output: true` and a shard layout);
- plain `P`: a local tensor holding a partial sum;
- a DTensor (`dt`): torch knows its placement and redistributes it as needed;
- unknown (`?`): we lost track (an op we do not model); nothing downstream is judged.

Styles change layouts at module boundaries exactly as torch's `_prepare_input_fn`
and `_prepare_output_fn` do; between modules, ops carry shards along the dims
they map (views, transposes, elementwise ops with broadcasting, attention,
reductions over other dims). What can go wrong is recorded as findings that
the TP32x rules turn into problems:

- `Mismatch`: a style annotates a plain tensor (`DTensor.from_local`) with a
  layout it does not have (a shard declared replicated, or the reverse);
- `Leak`: a plain shard or partial reaches what needs the full tensor: a module
  the plan leaves alone that has parameters, an op that mixes it with full
  tensors or reduces over the sharded dim, or the model's output;
- `Mixed`: a DTensor meets a plain tensor (torch raises);
- `Handoff`: a plain shard correctly annotated by the next style (TP324 checks
  that each degree divides it evenly);
- `ColwiseInput`, `CallSite`, `OutputSite`: facts for the arity and
  communication rules.

Only plans are interpreted, nothing runs: one pass over the events per plan,
independent of the TP degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.placements import PlacementSpec
from .facts import nested_parameters
from .text import shard_text
from .trace import Call, Op, Return, Trace

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Rule


@dataclass(frozen=True, slots=True)
class Source:
    """The module (and the plan rule that styles it) a layout comes from."""

    fqn: str
    rule: "Rule"


@dataclass(frozen=True, slots=True)
class Lay:
    kind: str  # 'R', 'S', 'P' or '?'
    dt: bool | None = False  # DTensor; None: unknown after a reported problem (judge nothing)
    dim: int | None = None  # S: the sharded dim of the full shape
    src: Source | None = None

    def text(self, ndim: int) -> str:
        base = shard_text(self.dim, ndim) if self.kind == "S" else {"R": "replicated", "P": "partial", "?": "unknown"}[self.kind]
        return f"{base} DTensor" if self.dt else base


# Styles beyond torch's, as the flow sees them: the expert styles own their module
# (inputs annotated, output reduced);
# local_params prepares inputs as prepare_module_input does (its module's ops are followed).
_FLOW_STYLES = {
    "expert_tp": "experts",
    "expert_parallel": "experts",
    "local_params": "prepare_module_input",
}


def flow_style(style: str) -> str:
    return _FLOW_STYLES.get(style, style)


REPLICATED = Lay("R")
DEAD = Lay("?", None)


def placement_lay(placement: PlacementSpec | None, ndim: int, dt: bool, src: Source | None) -> Lay | None:
    """The layout a placement gives a tensor of `ndim` dims; None for a shard dim out of range."""
    if placement is None or placement.kind == "replicate":
        return Lay("R", dt, None, src)
    if placement.kind == "partial":
        return Lay("P", dt, None, src)
    if not -ndim <= placement.dim < ndim:
        return None
    return Lay("S", dt, placement.dim % ndim, src)


# -- findings ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    fqn: str  # the module whose style annotates
    rule: "Rule"
    what: str  # "input 0", "input 'mask'", "output 0"
    declared: str  # placement text as the plan (or torch's default) says
    declared_default: bool  # the declaration is torch's default, not written in the plan
    actual: Lay
    shape: tuple
    impossible: bool = False  # the declared shard dim is out of range for the tensor


@dataclass(frozen=True)
class Leak:
    value: Lay  # plain S or P, with its source
    where: str  # 'module', 'output', 'op', 'reduce'
    fqn: str  # the module reached (where='module'), or the module the op runs in
    detail: str  # module class, op name
    shape: tuple

    @property
    def sequence(self) -> bool:
        """A shard of a non-feature dim (sequence parallelism), not of the last dim."""
        return self.value.kind == "S" and self.value.dim != len(self.shape) - 1


@dataclass(frozen=True)
class Mixed:
    value: Lay  # the DTensor
    shape: tuple  # its full shape
    fqn: str
    detail: str  # "op 'add'" or "module 'norm' (RMSNorm) whose parameters are plain tensors"


@dataclass(frozen=True)
class Handoff:
    value: Lay  # plain S, correctly declared by the consumer
    consumer: str
    rule: "Rule"
    size: int  # full size of the sharded dim
    ndim: int


@dataclass(frozen=True)
class ColwiseInput:
    fqn: str
    rule: "Rule"
    node: int
    value: Lay
    needs_grad: bool
    enclosing: tuple  # (fqn, Call) of the modules running around this call, innermost last


@dataclass(frozen=True)
class CallSite:
    fqn: str
    rule: "Rule"
    positional: int
    keywords: tuple
    first_is_tensor: bool


@dataclass(frozen=True)
class OutputSite:
    fqn: str
    rule: "Rule"
    count: int


@dataclass
class FlowReport:
    mismatches: list = field(default_factory=list)
    leaks: list = field(default_factory=list)
    mixed: list = field(default_factory=list)
    handoffs: list = field(default_factory=list)
    colwise_inputs: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    outputs: list = field(default_factory=list)


# -- op semantics -------------------------------------------------------------------

# Ops that apply per element (with broadcasting): a shard passes through unchanged.
ELEMENTWISE = frozenset("""
add sub mul div truediv floordiv true_divide floor_divide pow neg negative abs exp exp2 expm1 log log2 log10 log1p
sqrt rsqrt sin cos tan tanh sinh cosh asin acos atan atan2 sigmoid silu gelu relu relu6 leaky_relu elu selu celu
softplus softsign mish hardswish hardsigmoid hardtanh hardshrink softshrink tanhshrink logsigmoid erf erfc erfinv
clamp clamp_min clamp_max clip where masked_fill float half bfloat16 double int long bool to type type_as
contiguous clone detach dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d maximum minimum
fmax fmin sign sgn reciprocal square lerp addcmul addcdiv logical_and logical_or logical_not logical_xor eq ne lt
le gt ge greater less equal not_equal bitwise_and bitwise_or bitwise_xor bitwise_not and or xor invert mod remainder
fmod trunc floor ceil round frac nan_to_num isnan isinf isfinite copy fill zero requires_grad
masked_scatter threshold prelu rrelu xlogy copysign hypot nextafter float_power
""".split())
VIEWS = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as", "ravel"})
EXPANDS = frozenset({"expand", "expand_as", "broadcast_to"})
REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod", "all", "any",
    "argmax", "argmin", "count_nonzero", "nansum", "nanmean", "var_mean", "std_mean",
})
SHAPE_ONLY_OTHERS = frozenset({"type_as", "to", "view_as", "reshape_as", "expand_as", "new_empty", "new_zeros", "new_ones", "new_full"})
SPLITS = frozenset({"chunk", "split", "tensor_split", "unbind", "split_with_sizes"})


def _arg(op: Op, index: int, name: str, default: Any = None) -> Any:
    if name in op.kwargs:
        return op.kwargs[name]
    return op.args[index] if len(op.args) > index else default


def _dims(value: Any, ndim: int) -> tuple | None:
    """Normalized dims from an int or a sequence of ints; None when not plain ints."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not items or not all(isinstance(d, int) and not isinstance(d, bool) for d in items):
        return None
    if not all(-ndim <= d < max(ndim, 1) for d in items):
        return None
    return tuple(d % max(ndim, 1) for d in items)


def _view_dim(src: tuple, dst: tuple, dim: int) -> int | None:
    """Where a shard of `dim` goes when a tensor of shape `src` is viewed as `dst`.

    Dims are matched in groups of equal products. A shard of the outermost
    non-trivial dim of a group stays contiguous on the outermost non-trivial dim
    of the matching group (heads split out of features, features merged back);
    a shard of an inner dim of a merged group is interleaved: unknown.
    """
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                return None
        if dim in gi:
            outer_src = [d for d in gi if d < len(src) and src[d] != 1]
            outer_dst = [d for d in gj if d < len(dst) and dst[d] != 1]
            if not outer_src or outer_src[0] != dim or not outer_dst:
                return None
            return outer_dst[0]
    return None


def _index_dim(index: Any, shape: tuple, dim: int) -> int | None:
    """Where dim `dim` goes under basic indexing `x[index]`; None when it is indexed into
    (or the index is advanced)."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for item in items if item is not None and item is not Ellipsis)
    out = src = 0
    for item in items:
        if item is Ellipsis:
            skip = len(shape) - consumed
            if src <= dim < src + skip:
                return out + (dim - src)
            src, out = src + skip, out + skip
        elif item is None:
            out += 1
        elif isinstance(item, slice):
            if src == dim:
                full = item.start in (None, 0) and (item.stop is None or (isinstance(item.stop, int) and item.stop >= shape[dim])) and item.step in (None, 1)
                return out if full else None
            src, out = src + 1, out + 1
        elif isinstance(item, int) and not isinstance(item, bool):
            if src == dim:
                return None
            src += 1
        else:
            return None  # a tensor or list index: advanced indexing
    return out + (dim - src) if dim >= src else None


class _Interpreter:
    def __init__(self, trace: Trace, rules: dict[str, "Rule"], modules: dict[str, "nn.Module"]):
        self.trace = trace
        self.rules = rules
        self.modules = modules
        self.values: dict[int, Lay] = {}
        self.frames: list[_Frame] = []
        self.skip = 0
        self.report = FlowReport()

    def value(self, node: int | None) -> Lay:
        return REPLICATED if node is None else self.values.get(node, REPLICATED)

    def set(self, node: int, lay: Lay) -> None:
        if lay is REPLICATED:
            self.values.pop(node, None)
        else:
            self.values[node] = lay

    def shape(self, node: int) -> tuple:
        return self.trace.shapes[node]

    def where(self) -> str:
        return self.frames[-1].fqn if self.frames else ""

    def run(self) -> FlowReport:
        for event in self.trace.events:
            if isinstance(event, Op):
                if not self.skip:
                    self.op(event)
            elif isinstance(event, Call):
                if self.skip:
                    self.skip += 1
                else:
                    self.call(event)
            elif self.skip > 1:
                self.skip -= 1
            else:
                self.ret(event)
        return self.report

    # -- module boundaries ------------------------------------------------------------

    def annotate(self, node: int, declared: PlacementSpec | None, default: bool, frame: "_Frame", what: str) -> bool:
        """Check that a plain input (or output) really has the layout the style declares
        for it; False when the declaration is impossible (a shard dim out of range)."""
        have = self.value(node)
        if have.dt is not False or have.kind == "?":
            return True  # a DTensor is redistributed from its real layout; unknown: no judgement
        shape = self.shape(node)
        want = placement_lay(declared, len(shape), False, None)
        if want is None:  # a shard dim the tensor does not have
            self.report.mismatches.append(Mismatch(frame.fqn, frame.rule, what, str(declared), default, have, shape, impossible=True))
            self.set(node, DEAD)
            return False
        if (want.kind, want.dim) != (have.kind, have.dim):
            self.report.mismatches.append(Mismatch(frame.fqn, frame.rule, what, str(declared or "replicate"), default, have, shape))
        elif have.kind == "S":
            self.report.handoffs.append(Handoff(have, frame.fqn, frame.rule, shape[have.dim], len(shape)))
        return True

    def after(self, node: int, desired: PlacementSpec | None, local: bool, frame: "_Frame") -> None:
        lay = placement_lay(desired, len(self.shape(node)), not local, Source(frame.fqn, frame.rule))
        self.set(node, lay or DEAD)

    def call(self, event: Call) -> None:
        rule = self.rules.get(event.fqn)
        frame = _Frame(event.fqn, rule, event)
        self.frames.append(frame)
        spec = rule.spec if rule else None
        style = flow_style(spec.style) if spec else None
        if rule is not None:
            self.report.calls.append(CallSite(
                event.fqn, rule, len(event.args), tuple(event.kwargs), bool(event.args) and event.args[0] is not None
            ))
        if style in ("colwise", "rowwise", "sequence_parallel", "no_parallel", "experts"):
            frame.owned = True
            self.skip = 1
            if not self.applicable(style, event.fqn):
                frame.dead = True  # applying the plan fails here (TP300, TP301): judge nothing after it
                return
            first = event.args[0] if event.args else None
            if first is None:
                return
            declared, default = self.declared_input(style, spec, event.fqn)
            if style == "colwise":
                self.report.colwise_inputs.append(ColwiseInput(
                    event.fqn, rule, first, self.value(first), self.trace.needs_grad[first],
                    tuple((f.fqn, f.call) for f in self.frames[:-1]),
                ))
            self.annotate(first, declared, default, frame, "input 0")
        elif style in ("prepare_module_input", "prepare_module_input_output"):
            local = spec.use_local_input if spec.style == "prepare_module_input_output" else spec.use_local_output
            if spec.input_layouts is not None and len(spec.input_layouts) != len(event.args):
                frame.dead = True  # torch raises on the call (TP303 reports it): nothing inside is judged
                self.skip = 1
                return
            if spec.input_layouts is not None:
                for i, (node, layout, desired) in enumerate(zip(event.args, spec.input_layouts, spec.desired_input_layouts or ())):
                    if node is not None and layout is not None:
                        frame.save(node, self.value(node))
                        if self.annotate(node, layout, False, frame, f"input {i}"):
                            self.after(node, desired or layout, local, frame)
            for name, layout in (spec.input_kwarg_layouts or {}).items():
                node = event.kwargs.get(name)
                if node is not None:
                    frame.save(node, self.value(node))
                    if self.annotate(node, layout, False, frame, f"input '{name}'"):
                        self.after(node, (spec.desired_input_kwarg_layouts or {}).get(name) or layout, local, frame)
        elif rule is None:
            self.check_unplanned(frame)

    def applicable(self, style: str, fqn: str) -> bool:
        from torch import nn

        module = self.modules.get(fqn)
        if module is None:
            return True
        if style in ("colwise", "rowwise"):
            return isinstance(module, (nn.Linear, nn.Embedding))
        if style == "sequence_parallel":
            return not nested_parameters(module)
        return True

    def declared_input(self, style: str, spec, fqn: str) -> tuple[PlacementSpec | None, bool]:
        """The layout torch's style annotates a plain first input with, and whether it is
        torch's default rather than the plan's word."""
        if style == "sequence_parallel":
            return PlacementSpec("shard", spec.sequence_dim), False
        if style == "no_parallel":
            return spec.input_layout, False
        if style == "experts":
            return spec.input_layouts or PlacementSpec("replicate"), spec.input_layouts is None
        if spec.input_layouts is not None:
            return spec.input_layouts, False
        # torch's defaults: colwise replicate; rowwise shard(-1), even on an Embedding
        return (PlacementSpec("replicate") if style == "colwise" else PlacementSpec("shard", -1)), True

    def check_unplanned(self, frame: "_Frame") -> None:
        module = self.modules.get(frame.fqn)
        if module is None or not any(p is not None for p in module._parameters.values()):
            return
        nodes = [n for n in (*frame.call.args, *frame.call.kwargs.values()) if n is not None]
        for node in nodes:
            have = self.value(node)
            if have.dt is None:
                continue
            if have.dt:
                self.report.mixed.append(Mixed(
                    have, self.shape(node), frame.fqn, f"module '{frame.fqn}' ({type(module).__name__}), whose parameters are plain tensors"
                ))
            elif have.kind in ("S", "P"):
                self.report.leaks.append(Leak(have, "module", frame.fqn, type(module).__name__, self.shape(node)))
            else:
                continue
            frame.dead = True
            self.skip = 1
            return

    def ret(self, event: Return) -> None:
        frame = self.frames.pop()
        spec = frame.rule.spec if frame.rule else None
        if frame.owned or frame.dead:
            self.skip = 0
            self.owned_outputs(frame, spec, event)
        else:
            frame.restore(self)
            if spec is not None and spec.style in ("prepare_module_output", "prepare_module_input_output"):
                self.report.outputs.append(OutputSite(frame.fqn, frame.rule, len(event.outputs) if event.is_tuple else 1))
                if len(spec.output_layouts) != (len(event.outputs) if event.is_tuple else 1):
                    for node in event.flat:
                        self.set(node, DEAD)  # torch raises on the return (TP303 reports it)
                else:
                    for i, (node, layout, desired) in enumerate(zip(event.outputs, spec.output_layouts, spec.desired_output_layouts)):
                        if node is not None and layout is not None:
                            if self.annotate(node, layout, False, frame, f"output {i}"):
                                self.after(node, desired or layout, spec.use_local_output, frame)
        if not self.frames:  # the model's own output
            for node in event.flat:
                have = self.value(node)
                if have.dt is False and have.kind in ("S", "P"):
                    self.report.leaks.append(Leak(have, "output", event.fqn, "", self.shape(node)))

    def owned_outputs(self, frame: "_Frame", spec, event: Return) -> None:
        if frame.dead:
            for node in event.flat:
                self.set(node, DEAD)
            return
        node = event.outputs[0] if event.outputs else None
        if node is None:
            return
        src = Source(frame.fqn, frame.rule)
        ndim = len(self.shape(node))
        style = flow_style(spec.style)
        if style == "sequence_parallel":
            lay = placement_lay(PlacementSpec("shard", spec.sequence_dim), ndim, not spec.use_local_output, src)
        elif style == "no_parallel":
            lay = placement_lay(spec.output_layout, ndim, not spec.use_local_output, src)
        else:
            natural = PlacementSpec("shard", -1) if style == "colwise" else PlacementSpec("replicate")
            lay = placement_lay(getattr(spec, "output_layouts", None) or natural, ndim, not spec.use_local_output, src)
        self.set(node, lay or Lay("?", False, None, src))

    # -- ops ------------------------------------------------------------------------------

    def op(self, op: Op) -> None:
        values = [self.value(n) for n in op.inputs]
        if all(v.kind == "R" and v.dt is False for v in values):
            lay = next((v for v in values if v.src is not None), REPLICATED)
            for node in op.outputs:
                self.set(node, lay)
            return
        dead = next((v for v in values if v.dt is None), None)
        if dead is not None:
            return self.set_all(op, dead)
        dts = [v for v in values if v.dt]
        if dts:
            plain = [i for i, v in enumerate(values) if not v.dt and math.prod(self.shape(op.inputs[i])) > 1]
            if plain:
                first_dt = next(i for i, v in enumerate(values) if v.dt)
                self.report.mixed.append(Mixed(
                    dts[0], self.shape(op.inputs[first_dt]), self.where(),
                    f"a plain tensor of shape {self.shape(op.inputs[plain[0]])} in '{op.name}'",
                ))
                return self.set_all(op, Lay("?", None, None, dts[0].src))
            same = len(values) == 1 and all(self.shape(o) == self.shape(op.inputs[0]) for o in op.outputs) and op.name in ELEMENTWISE
            return self.set_all(op, values[0] if same else Lay("?", True, None, dts[0].src))
        unknown = next((v for v in values if v.kind == "?"), None)
        if unknown is not None:
            return self.set_all(op, unknown)
        outs = self.semantics(op, values)
        if isinstance(outs, Leak):
            self.report.leaks.append(outs)
            return self.set_all(op, Lay("?", None, None, outs.value.src))
        if outs is None:
            src = next(v.src for v in values if v.kind != "R")
            return self.set_all(op, Lay("?", False, None, src))
        for node, lay in zip(op.outputs, outs):
            self.set(node, lay)

    def set_all(self, op: Op, lay: Lay) -> None:
        for node in op.outputs:
            self.set(node, lay)

    def leak(self, value: Lay, where: str, op: Op, node: int) -> Leak:
        return Leak(value, where, self.where(), op.name, self.shape(node))

    def semantics(self, op: Op, values: list[Lay]) -> "list[Lay] | Leak | None":
        """Output layouts of an op on plain inputs, some sharded or partial; a Leak when
        the op needs what the shard lacks; None when we do not model it."""
        name = op.name
        shapes = [self.shape(n) for n in op.inputs]
        if name in SHAPE_ONLY_OTHERS:
            # type_as(x, other), view_as(x, other): `other` lends a dtype or a shape, not values
            values, shapes = values[:1], shapes[:1]
            if values[0].kind == "R":
                return [values[0]] * len(op.outputs)
        first = values[0]
        out_shapes = [self.shape(n) for n in op.outputs]
        if not out_shapes:
            return []
        sharded = [(i, v) for i, v in enumerate(values) if v.kind != "R"]
        if any(v.kind == "P" for _, v in sharded):
            if name in ("add", "sub") and all(v.kind == "P" for v in values):
                return [values[0]] * len(out_shapes)
            if name in ("mul", "div", "truediv", "neg", "to", "float", "type_as", "contiguous", "clone", "view", "reshape") and len(sharded) == 1:
                others = [i for i, v in enumerate(values) if v.kind == "R" and math.prod(shapes[i]) > 1]
                return None if others else [sharded[0][1]] * len(out_shapes)
            return None

        if name in ("max", "min") and len(op.inputs) > 1:
            return self.elementwise(op, values, shapes, out_shapes)  # torch.min(x, other): per element
        if name in ELEMENTWISE or (name in ("softmax", "log_softmax", "layer_norm", "rms_norm") and self.keeps_dim(op, values, shapes)):
            return self.elementwise(op, values, shapes, out_shapes)
        if name in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
            return self.leak(sharded[0][1], "reduce", op, op.inputs[sharded[0][0]])
        if len(sharded) != 1 or sharded[0][0] != 0:
            return self.multi(op, values, shapes, out_shapes)
        dim, src, shape = first.dim, first.src, shapes[0]
        out = out_shapes[0]
        moved: int | None = None
        if name in VIEWS:
            moved = _view_dim(shape, out, dim) if math.prod(shape) == math.prod(out) else None
        elif name in EXPANDS:
            new = dim + len(out) - len(shape)
            moved = new if out[new] == shape[dim] else None
        elif name == "repeat":
            reps = op.args[1:] if len(op.args) > 1 and not isinstance(op.args[1], tuple) else (op.args[1] if len(op.args) > 1 else ())
            new = dim + len(out) - len(shape)
            moved = new if len(reps) == len(out) and reps[new] == 1 else None
        elif name in ("transpose", "swapaxes", "swapdims"):
            pair = _dims((_arg(op, 1, "dim0"), _arg(op, 2, "dim1")), len(shape))
            moved = None if pair is None else pair[1] if dim == pair[0] else pair[0] if dim == pair[1] else dim
        elif name in ("t", "T", "mT"):
            n = len(shape)
            moved = (n - 1 - dim) if name == "T" or n <= 2 else (n - 2 if dim == n - 1 else n - 1 if dim == n - 2 else dim)
        elif name == "permute":
            order = op.args[1:] if len(op.args) > 1 and not isinstance(op.args[1], tuple) else _arg(op, 1, "dims", ())
            order = _dims(tuple(order), len(shape))
            moved = order.index(dim) if order is not None and dim in order else None
        elif name == "movedim":
            src_dims, dst_dims = _dims(_arg(op, 1, "source"), len(shape)), _dims(_arg(op, 2, "destination"), len(shape))
            if src_dims is not None and dst_dims is not None and len(src_dims) == len(dst_dims):
                order = [None] * len(shape)
                for s, d in zip(src_dims, dst_dims):
                    order[d] = s
                rest = iter(d for d in range(len(shape)) if d not in src_dims)
                order = [o if o is not None else next(rest) for o in order]
                moved = order.index(dim)
        elif name == "getitem":
            moved = _index_dim(_arg(op, 1, "index"), shape, dim)
        elif name in REDUCTIONS:
            reduced = _arg(op, 1, "dim")
            if reduced is None or isinstance(reduced, str):
                return self.leak(first, "reduce", op, op.inputs[0])
            dims = _dims(reduced, len(shape))
            if dims is None:
                return None
            if dim in dims:
                return self.leak(first, "reduce", op, op.inputs[0])
            keep = _arg(op, 2, "keepdim", False)
            moved = dim if keep else dim - sum(1 for d in dims if d < dim)
        elif name in SPLITS:
            along = _dims(_arg(op, 2 if name != "unbind" else 1, "dim", 0), len(shape))
            if along is None or along[0] == dim:
                return None
            moved = dim if name != "unbind" else dim - (1 if along[0] < dim else 0)
        elif name in ("linear", "embedding"):
            if name == "linear" and dim == len(shape) - 1:
                return None  # contracting a shard with a full weight (an unplanned Linear reports it)
            moved = dim
        if moved is None or not all(len(s) > moved and s[moved] != 1 for s in out_shapes):
            return None
        return [Lay("S", False, moved, src)] * len(out_shapes)

    def keeps_dim(self, op: Op, values: list[Lay], shapes: list[tuple]) -> bool:
        """softmax / norms compute over some dims: fine as long as the shard is elsewhere."""
        shard = values[0]
        if shard.kind != "S":
            return False
        ndim = len(shapes[0])
        if op.name in ("softmax", "log_softmax"):
            dims = _dims(_arg(op, 1, "dim"), ndim)
        else:
            normalized = _arg(op, 1, "normalized_shape")
            count = len(normalized) if isinstance(normalized, tuple) else 1
            dims = tuple(range(ndim - count, ndim))
        return dims is not None and shard.dim not in dims

    def elementwise(self, op: Op, values: list[Lay], shapes: list[tuple], out_shapes: list[tuple]) -> "list[Lay] | Leak | None":
        out = out_shapes[0]
        aligned: set[int] = set()
        shard_index = None
        for i, v in enumerate(values):
            if v.kind == "S":
                aligned.add(v.dim + len(out) - len(shapes[i]))
                # the most recently made shard names the source: the rule that last touched it
                if shard_index is None or op.inputs[i] > op.inputs[shard_index]:
                    shard_index = i
        if len(aligned) != 1:
            return self.leak(values[shard_index], "op", op, op.inputs[shard_index])  # two shards of different dims meet
        dim = aligned.pop()
        if not 0 <= dim < len(out):
            return None
        for i, v in enumerate(values):
            if v.kind == "R":
                j = dim - (len(out) - len(shapes[i]))
                if 0 <= j < len(shapes[i]) and shapes[i][j] != 1:
                    return self.leak(values[shard_index], "op", op, op.inputs[shard_index])  # a full tensor meets the shard
        if not all(s == out for s in out_shapes):
            return None
        return [Lay("S", False, dim, values[shard_index].src)] * len(out_shapes)

    def multi(self, op: Op, values: list[Lay], shapes: list[tuple], out_shapes: list[tuple]) -> "list[Lay] | Leak | None":
        """Ops with several inputs or the shard not first: matmul, attention, cat, stack."""
        name = op.name
        shards = [(i, v) for i, v in enumerate(values) if v.kind == "S"]
        src = shards[0][1].src
        if name in ("matmul", "bmm", "mm") and len(values) == 2 and all(len(s) >= 2 for s in shapes):
            (a, b), (sa, sb) = values, shapes
            n = len(out_shapes[0])
            da = a.dim + n - len(sa) if a.kind == "S" else None
            db = b.dim + n - len(sb) if b.kind == "S" else None
            batch = n - 2
            if da is not None and db is not None:
                if da == db and da < batch:
                    return [Lay("S", False, da, src)]
                if a.dim == len(sa) - 1 and b.dim == len(sb) - 2:
                    return [Lay("P", False, None, src)]  # contraction of two matching shards: partial sums
                return None
            if da is not None:
                return [Lay("S", False, da, src)] if da == n - 2 or (da < batch and self.broadcasts(sb, n, da)) else None
            return [Lay("S", False, db, src)] if db == n - 1 or (db < batch and self.broadcasts(sa, n, db)) else None
        if name == "scaled_dot_product_attention" and len(values) >= 3:
            qkv = values[:3]
            if all(v.kind == "S" for v in qkv) and len({v.dim for v in qkv}) == 1 and qkv[0].dim < len(shapes[0]) - 2:
                dim = qkv[0].dim
                if all(v.kind == "R" and self.broadcasts(shapes[i], len(out_shapes[0]), dim) for i, v in enumerate(values) if i >= 3):
                    return [Lay("S", False, dim, src)] * len(out_shapes)
            return None
        if name in ("cat", "concat", "concatenate", "stack") and all(len(s) == len(shapes[0]) for s in shapes):
            ndim = len(shapes[0])
            along = _arg(op, 1, "dim", 0)
            dims = {v.dim for _, v in shards}
            if len(dims) != 1 or not isinstance(along, int):
                return None
            dim = dims.pop()
            along = along % (ndim + 1 if name == "stack" else ndim)
            if name != "stack" and along == dim:
                return None
            for i, v in enumerate(values):
                if v.kind == "R" and shapes[i][dim] != 1:
                    return self.leak(shards[0][1], "op", op, op.inputs[shards[0][0]])
            return [Lay("S", False, dim + (1 if name == "stack" and along <= dim else 0), src)]
        if name in ELEMENTWISE:
            return self.elementwise(op, values, shapes, out_shapes)
        return None  # not modelled: the shard's fate is unknown, nothing after it is judged

    @staticmethod
    def broadcasts(shape: tuple, ndim: int, dim: int) -> bool:
        j = dim - (ndim - len(shape))
        return j < 0 or shape[j] == 1


@dataclass
class _Frame:
    fqn: str
    rule: "Rule | None"
    call: Call
    owned: bool = False  # the style runs the module in DTensor land: its inside is torch's business
    dead: bool = False  # a problem was reported at its door; nothing inside is judged
    saved: list = field(default_factory=list)

    def save(self, node: int, lay: Lay) -> None:
        self.saved.append((node, lay))

    def restore(self, interpreter: _Interpreter) -> None:
        for node, lay in reversed(self.saved):
            interpreter.set(node, lay)


def analyze(trace: Trace, rules: dict[str, "Rule"], modules: dict[str, "nn.Module"]) -> FlowReport:
    """Follow the layouts of one traced forward under the plan's {fqn: rule}."""
    return _Interpreter(trace, rules, modules).run()

