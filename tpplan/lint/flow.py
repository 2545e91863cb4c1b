"""Layout flow: follow each tensor of one traced forward through the plan.

Abstract interpretation over a `Trace`. Every tensor gets a layout under the
plan (layouts.py: replicated, a plain shard, a partial sum, a DTensor, or
unknown), as torch would give it at run time. At module boundaries, styles
change layouts exactly as torch's `_prepare_input_fn` and `_prepare_output_fn`
do, as the style table (core/style_table.py) describes each style: which input it
takes, the layout it declares for it, the layout of its output, whether it
runs the module in DTensor land. Between modules, ops carry shards along the
dims they map (ops.py). What can go wrong is recorded as findings (layouts.py)
that the TP32x rules turn into problems.

Only plans are interpreted, nothing runs: one pass over the events per plan,
independent of the TP degree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.placements import PlacementSpec
from ..core.problems import StyleInputError
from .facts import module_kind, nested_parameters
from .layouts import (
    DEAD,
    REPLICATED,
    CallSite,
    ColwiseInput,
    FlowReport,
    Fused,
    Handoff,
    Lay,
    Leak,
    Mismatch,
    Mixed,
    OutputSite,
    OwnParam,
    Source,
    Stop,
    placement_lay,
)
from .grad_sums import GradSums
from .ops import ELEMENTWISE, EXPANDS, SHAPE_ONLY_OTHERS, OpSemantics
from .partial import PartialSums
from .sharded_body import PartialBody
from .trace import Call, Op, Return, Trace

_REPLICATE = PlacementSpec("replicate")
_PARTIAL = PlacementSpec("partial")

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Rule


class _Interpreter:
    def __init__(self, trace: Trace, rules: dict[str, "Rule"], modules: dict[str, "nn.Module"]):
        self.trace = trace
        self.rules = rules
        self.modules = modules
        self.values: dict[int, Lay] = {}
        self.frames: list[_Frame] = []
        self.skip = 0
        self.body: PartialBody | None = None  # the ops inside a module whose style reduces its partial output
        self.report = FlowReport()
        self.partials = PartialSums()
        self.ops = OpSemantics(self.shape, self.where, lambda node: self.uniform.get(node, frozenset()), self.partials.layouts)
        self.sums = GradSums(modules)
        self.report.grad_sums, self.report.shared_operands = self.sums.found, self.sums.shared_operands
        # a replicated tensor expanded from size 1 (`k_rot.expand(-1, heads, -1, -1)`): the same values along
        # those dims, whatever their size on a rank, so it meets a shard there as a broadcast would
        self.uniform: dict[int, frozenset] = {}
        # node -> (parameter node, where each of its dims went): views of a parameter
        self.derived: dict[int, tuple[int, tuple]] = {n: (n, tuple(range(len(self.shape(n))))) for n in trace.params}
        self.own_params()

    def own_params(self) -> None:
        """The parameters a local_params rule shards (`params: {sinks: shard(0)}`) are local
        shards wherever the module's forward uses them; the others stay replicated."""
        for node, (fqn, name) in self.trace.params.items():
            rule = self.rules.get(fqn)
            layouts = rule.spec.local_param_placements() if rule is not None else None
            if layouts and name in layouts:
                lay = placement_lay(layouts[name], len(self.shape(node)), False, Source(fqn, rule))
                if lay is not None and lay.kind == "S":
                    self.set(node, lay)

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
                elif self.body is not None:
                    self.body.op(event)
                self.partials.seen(event)  # in a module run whole too: it may write into zeros it returns
            elif isinstance(event, Call):
                if self.skip:
                    self.skip += 1
                    if self.body is not None:
                        self.body.enter(event.fqn)
                else:
                    self.call(event)
            elif self.skip > 1:
                self.skip -= 1
                if self.body is not None:
                    self.body.leave()
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
            self.report.mismatches.append(Mismatch(frame.fqn, frame.rule, what, declared, default, have, shape, impossible=True))
            self.set(node, DEAD)
            return False
        # a strided shard's rows are no contiguous shard(d); only a style that hands each row back
        # where it came from (all_to_all dispatch) does not care which rows a rank holds
        strided = have.kind == "S" and have.split > 1 and not (what == "input 0" and frame.owned and frame.rule.spec.output_follows_input())
        if (want.kind, want.dim) != (have.kind, have.dim) or strided:
            self.report.mismatches.append(Mismatch(frame.fqn, frame.rule, what, declared or _REPLICATE, default, have, shape))
        elif have.kind == "S" and have.blocks is not None:  # [q_r | k_r | v_r] is no contiguous shard
            self.report.fused.append(Fused(have, frame.fqn, frame.rule.pattern, shape, "handoff"))
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
        semantics = spec.semantics if spec else None
        if rule is not None:
            self.report.calls.append(CallSite(
                event.fqn, rule, len(event.args), tuple(event.kwargs), bool(event.args) and event.args[0] is not None
            ))
        if semantics is not None and semantics.contract.tp.body != "traced":  # the style runs the module
            frame.owned = True
            self.skip = 1
            if not self.applicable(semantics, event.fqn):
                frame.dead = True  # applying the plan fails here (TP300, TP301): judge nothing after it
                return
            if semantics.contract.tp.body == "unknown":
                return  # a class the plan names without `like:` (TP307): its inputs are not judged
            self.body = self.partial_body(event.fqn, rule)
            first = event.args[0] if event.args else None
            declared_input = spec.declared_input()
            if first is None or declared_input is None:  # no first input, or the contract lays out none
                return
            declared, default = declared_input
            if spec.contract().inputs[0].grad == "sum":  # backward sums its gradient: siblings sharing it pay (TP340)
                self.report.colwise_inputs.append(ColwiseInput(
                    event.fqn, rule, first, self.value(first), self.trace.needs_grad[first],
                    tuple((f.fqn, f.call) for f in self.frames[:-1]),
                ))
            self.annotate(first, declared, default, frame, "input 0")
        elif semantics is not None and semantics.inputs == "layouts":
            local = spec.inputs_local()
            if spec.input_layouts is not None and len(spec.input_layouts) != len(event.args):
                frame.dead = True  # torch raises on the call (TP303 reports it): nothing inside is judged
                self.skip = 1
                return
            if spec.input_layouts is not None:
                for i, (node, layout, desired) in enumerate(zip(event.args, spec.input_layouts, spec.desired_input_layouts or ())):
                    if node is not None and layout is not None and not self.label_only(node, layout, desired, local):
                        frame.save(node, self.value(node))
                        if self.annotate(node, layout, False, frame, f"input {i}"):
                            self.after(node, desired or layout, local, frame)
            for name, layout in (spec.input_kwarg_layouts or {}).items():
                node = event.kwargs.get(name)
                desired = (spec.desired_input_kwarg_layouts or {}).get(name)
                if node is not None and not self.label_only(node, layout, desired, local):
                    frame.save(node, self.value(node))
                    if self.annotate(node, layout, False, frame, f"input '{name}'"):
                        self.after(node, desired or layout, local, frame)
        elif rule is None:
            self.check_unplanned(frame)

    def label_only(self, node: int, layout: PlacementSpec, desired: PlacementSpec | None, local: bool) -> bool:
        """Whether laying out a plain input is a label that changes nothing: declared and
        desired alike and handed on local, `DTensor.from_local(x, layout).to_local()` is `x`
        forward and backward (no redistribution, no grad_placements), so the module computes
        on the tensor as it arrives, whatever the label says (transformers' Dots3 plan
        declares its shared one-head rotary key shard(1) for its local_params norm). A shard
        dim the tensor lacks is still judged (from_local's shape is impossible)."""
        return (
            local and (desired is None or desired == layout) and self.value(node).dt is False
            and placement_lay(layout, len(self.shape(node)), False, None) is not None
        )

    def partial_body(self, fqn: str, rule: "Rule") -> PartialBody | None:
        """A watch over the body of a module whose style runs it on its parameters' local
        slices and reduces its output as a partial sum (expert_tp): sharded_body.py."""
        contract, module = rule.spec.contract(), self.modules.get(fqn)
        if module is None or not contract.outputs or contract.outputs[0].src != _PARTIAL:
            return None
        try:
            placed = rule.spec.param_placements(module)
        except StyleInputError:
            return None  # parameters the style cannot place: TP30x report it
        if not placed:
            return None  # torch's own styles (rowwise): their placements are the table's, their body a Linear's
        sharded = {node for node, (owner, name) in self.trace.params.items()
                   if owner == fqn and getattr(placed.get(name), "kind", None) == "shard"}
        return PartialBody(fqn, rule, sharded, self.partials, self.shape) if sharded else None

    def applicable(self, semantics, fqn: str) -> bool:
        """Whether applying the style to module `fqn` works (TP300 and TP301 report where not)."""
        module = self.modules.get(fqn)
        if module is None:
            return True
        if semantics.contract.tp.kinds and module_kind(module) not in semantics.contract.tp.kinds:
            return False
        return not (semantics.flat_params and nested_parameters(module))

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
        self.sums.returned_by(frame.fqn, event.flat)
        spec = frame.rule.spec if frame.rule else None
        if frame.owned or frame.dead:
            self.skip = 0
            if self.body is not None and self.body.leak is not None:
                self.report.leaks.append(self.body.leak)
            self.body = None
            self.owned_outputs(frame, spec, event)
            self.sums.passed((*frame.call.args, *frame.call.kwargs.values()), event.flat)
        else:
            frame.restore(self)
            if spec is not None and any(port.each for port in spec.semantics.contract.tp.outputs):  # laid out per output
                self.report.outputs.append(OutputSite(frame.fqn, frame.rule, len(event.outputs) if event.is_tuple else 1))
                if len(spec.output_layouts) != (len(event.outputs) if event.is_tuple else 1):
                    for node in event.flat:
                        self.set(node, DEAD)  # torch raises on the return (TP303 reports it)
                else:
                    for i, (node, layout, desired) in enumerate(zip(event.outputs, spec.output_layouts, spec.desired_output_layouts)):
                        if node is not None and layout is not None and self.annotate(node, layout, False, frame, f"output {i}"):
                            self.after(node, desired or layout, spec.use_local_output, frame)
            if spec is not None and any(port.grad == "sum" for port in spec.semantics.contract.tp.outputs):
                self.sums.returned(frame.fqn, frame.rule, event.flat)
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
        contract = spec.semantics.contract.tp
        if contract.body == "unknown" or not contract.outputs:  # what comes out is unknown: judge nothing that follows
            for out in event.flat:
                self.set(out, Lay("?", False, None, src))
            return
        ndim = len(self.shape(node))
        first = frame.call.args[0] if frame.call.args else None
        if spec.output_follows_input() and first is not None and spec.use_local_output:
            # Tokens come back to the rank that sent them: the output is laid out as the input.
            have = self.value(first)
            self.set(node, dataclasses.replace(have, src=src) if have.kind != "?" else Lay("?", False, None, src))
            return
        lay = placement_lay(spec.natural_output(), ndim, not spec.use_local_output, src)
        if lay is not None and lay.kind == "S" and not lay.dt:
            lay = dataclasses.replace(lay, blocks=spec.packed_blocks(self.shape(node)[lay.dim]))
        self.set(node, lay or Lay("?", False, None, src))

    # -- ops ------------------------------------------------------------------------------

    def op(self, op: Op) -> None:
        values = [self.value(n) for n in op.inputs]
        self.layouts_of(op, values)
        self.derive(op, values)
        if op.name in EXPANDS and len(op.outputs) == 1 and values[0].kind == "R":
            shape, out = self.shape(op.inputs[0]), self.shape(op.outputs[0])
            lead = len(out) - len(shape)
            self.uniform[op.outputs[0]] = frozenset(d for d in range(len(out)) if out[d] != 1 and (d < lead or shape[d - lead] == 1))
        results = [self.value(n) for n in op.outputs]
        if not self.in_local_params():
            self.sums.operands(op, values, results, self.trace, self.where())
        self.sums.op(op.inputs, values, op.outputs, results)

    def derive(self, op: Op, values: list[Lay]) -> None:
        """Follow a replicated parameter's dims through the ops that only reshape it
        (`sinks.view(1, -1, 1)`, `.expand(...)`, `.to(...)`), the way a shard of each would go."""
        found = self.derived.get(op.inputs[0]) if op.inputs else None
        if found is None or len(op.outputs) != 1 or values[0].kind != "R" or values[0].dt is not False:
            return
        if len(op.inputs) > 1 and op.name not in SHAPE_ONLY_OTHERS:
            return
        param, dims = found
        out = self.shape(op.outputs[0])
        moved = []
        for dim in dims:
            lays = None if dim is None else self.ops.semantics(op, [Lay("S", False, dim), *values[1:]])
            new = lays[0].dim if isinstance(lays, list) and lays and lays[0].kind == "S" else None
            moved.append(new if new is not None and out[new] == self.shape(op.inputs[0])[dim] else None)
        if any(d is not None for d in moved):
            self.derived[op.outputs[0]] = (param, tuple(moved))

    def own_param(self, leak: Leak) -> Leak:
        """`leak` with the parameter (of a module running around the op) whose view is the
        full tensor it meets, when sharding that parameter on the facing dim fits the shard."""
        if leak.against is None or leak.value.kind != "S":
            return leak
        node, dim = leak.against
        param, dims = self.derived.get(node, (None, ()))
        if param is None or dim not in dims or (self.value(param).kind, self.value(param).dt) != ("R", False):
            return leak
        owner, name = self.trace.params[param]
        at = dims.index(dim)
        size = self.shape(param)[at]
        if size != leak.shape[leak.value.dim] or size != self.shape(node)[dim]:
            return leak
        if not any(f.fqn == owner and not f.owned for f in self.frames):
            return leak  # not the running module's own: another module's weight, used here whole
        return dataclasses.replace(leak, param=OwnParam(owner, name, at))

    def in_local_params(self) -> bool:
        """Inside a planned module with parameters of its own that computes on local tensors
        (local_params): its style sums their gradients, whatever they meet."""
        return any(
            f.rule is not None and f.rule.spec.semantics.inputs == "layouts" and f.fqn in self.modules
            and any(p is not None for p in self.modules[f.fqn]._parameters.values())
            for f in self.frames
        )

    def layouts_of(self, op: Op, values: list[Lay]) -> None:
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
        outs = self.ops.semantics(op, values)
        if isinstance(outs, Leak):
            outs = self.own_param(outs)
            self.report.leaks.append(outs)
            return self.set_all(op, Lay("?", None, None, outs.value.src))
        if isinstance(outs, Fused):
            self.report.fused.append(outs)
            return self.set_all(op, Lay("?", None, None, outs.value.src))
        if outs is None:
            index, stopped = next((i, v) for i, v in enumerate(values) if v.kind != "R")
            self.report.stops.append(Stop(stopped, op.name, self.where(), self.shape(op.inputs[index])))
            return self.set_all(op, Lay("?", False, None, stopped.src))
        for node, lay in zip(op.outputs, outs):
            self.set(node, lay)

    def set_all(self, op: Op, lay: Lay) -> None:
        for node in op.outputs:
            self.set(node, lay)

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

