"""Record what the model's forward does, once, without real data.

The layout-flow checks need to know which tensor each module receives and how
the functions between modules transform it. We run the unparallelized model's
forward under a `TorchFunctionMode` and keep a flat list of events: `Call` and
`Return` of every module (with the node ids of its tensor inputs and outputs)
and `Op` for every torch function applied to tensors in between. The forward
runs however the caller set it up: the lint (context.py) tries the meta
device, then FakeTensorMode, then, for a small model, random values on the CPU
(simulation/ladder.py); this module only records. A node id names one tensor; its full shape is in `Trace.shapes`.

The trace does not depend on the plan or the TP degree, so one trace serves
every check, rule and degree.

Meta and fake kernels are slow (hundreds of microseconds per op), so a
1,000-layer model would take seconds to trace. Blocks repeat, though: a module whose
structure (class, parameters, submodules, plain attributes) and inputs
(shapes, dtypes, plain arguments) equal those of an earlier call is not run
again. Its recorded events are replayed under the new path with fresh node
ids, and empty outputs of the recorded shapes are returned. The structure is
block identity's (simulation/blocks.py, `Structures`), which the lint's collapse
reads too: attributes that only number a block (`layer_idx`, `layer_id`, ...) are
left out of it, so the layers of a decoder share one recording.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..simulation.blocks import Structures


@dataclass(slots=True)
class Call:
    fqn: str
    args: tuple  # one entry per positional argument: its node id, or None when it is not a tensor
    kwargs: dict  # keyword -> node id, or None when it is not a tensor


@dataclass(slots=True)
class Return:
    fqn: str
    outputs: tuple  # node id (or None) per output; one entry unless the forward returned a tuple
    is_tuple: bool
    flat: tuple  # node ids of every tensor in the output, however nested (dicts, model outputs)


@dataclass(slots=True)
class Op:
    name: str  # normalized: 'mul' for __rmul__, 'add' for add_
    inputs: tuple  # node ids of the tensor arguments, in argument order
    outputs: tuple  # node ids of the tensor results
    args: tuple  # the arguments with tensors replaced by TENSOR and other objects by None
    kwargs: dict


TENSOR = "<tensor>"
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass
class Trace:
    events: list = field(default_factory=list)
    shapes: list = field(default_factory=list)  # node id -> full shape
    needs_grad: list = field(default_factory=list)  # node id -> derived from a trainable parameter
    inputs: tuple = ()  # node ids of the model's positional inputs
    params: dict = field(default_factory=dict)  # node id -> (module fqn, name) of a parameter
    structures: Any = None  # the blocks.Structures of the traced modules (by module identity)

    def new_node(self, shape: tuple, needs_grad: bool) -> int:
        self.shapes.append(shape)
        self.needs_grad.append(needs_grad)
        return len(self.shapes) - 1


class TraceError(Exception):
    """The model's forward raises on the example inputs (in the mode it was run in)."""


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a property such as Tensor.T
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    name = name.strip("_")  # __mul__ -> mul, add_ (in place) -> add
    if name.startswith(("r", "i")) and name[1:] in _REVERSIBLE:
        name = name[1:]  # __rmul__, __iadd__
    return name


_REVERSIBLE = {"add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "mod", "and", "or", "xor", "lshift", "rshift", "div"}


def _simplify(value: Any, depth: int = 0) -> Any:
    """Arguments as plain data (for dims and sizes), tensors as TENSOR."""
    if isinstance(value, torch.Tensor):
        return TENSOR
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, slice):
        return slice(*(_simplify(v, depth + 1) for v in (value.start, value.stop, value.step)))
    if value is Ellipsis:
        return value
    if isinstance(value, (tuple, list)) and depth < 3:
        items = [_simplify(v, depth + 1) for v in value]
        # a list stays a list: in an index it means advanced indexing, not one index per dim
        return items if type(value) is list else tuple(items)
    return None


def _tensors(value: Any, out: list, depth: int = 0) -> list:
    """Tensors inside `value` (tuples, lists and dicts, three levels deep), in order."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth < 3 and isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, out, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            _tensors(item, out, depth + 1)
    return out


def _input_key(value: Any, seen: dict, depth: int = 0) -> Any:
    """A hashable summary of call arguments for memoization; raises TypeError when an
    argument is an object whose state we cannot see (no memoization then)."""
    if isinstance(value, torch.Tensor):
        # The same tensor passed twice must stay the same tensor in a replay.
        first = seen.setdefault(id(value), len(seen))
        return ("T", tuple(value.shape), value.dtype, first)
    if isinstance(value, _PLAIN):
        return value
    if depth < 3 and isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_input_key(v, seen, depth + 1) for v in value))
    if depth < 3 and isinstance(value, dict):
        return ("dict", tuple((k, _input_key(v, seen, depth + 1)) for k, v in value.items()))
    raise TypeError("opaque argument")


@dataclass
class _Recording:
    fqn: str
    events: list
    input_nodes: list  # node ids of the recorded call's tensor inputs, in `_tensors` order
    output: Any  # the output structure with node ids in place of tensors
    output_meta: dict  # node id -> (shape, dtype, device)


class _Tracer(TorchFunctionMode):
    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        self.ids: dict[int, int] = {}
        self.keep: list = []  # tensors we gave ids to stay alive, so no id() is reused
        self.replaying = False
        self.memo: dict = {}
        self.structures = Structures()
        self.param_nodes: dict[tuple[str, str], int] = {}  # (module fqn, name) -> node id

    def parameters(self, model: nn.Module) -> None:
        """A node for each parameter, named by its module, for the layouts of those a
        style lays out itself (local_params' `params`)."""
        for fqn, module in model.named_modules():
            for name, param in module._parameters.items():
                if param is not None:
                    nid = self.node(param)
                    self.trace.params.setdefault(nid, (fqn, name))
                    self.param_nodes[(fqn, name)] = nid

    def node(self, tensor: torch.Tensor) -> int:
        nid = self.ids.get(id(tensor))
        if nid is None:
            needs_grad = isinstance(tensor, nn.Parameter) and tensor.requires_grad
            nid = self.trace.new_node(tuple(tensor.shape), needs_grad)
            self.ids[id(tensor)] = nid
            self.keep.append(tensor)
        return nid

    def bind(self, tensor: torch.Tensor, nid: int) -> None:
        self.ids[id(tensor)] = nid
        self.keep.append(tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.replaying:
            return out
        ins = _tensors(args, [])
        if kwargs:
            _tensors(kwargs, ins)
        name = _op_name(func)
        if not ins:  # creation ops make plain, replicated tensors (the default); zeros are kept: see ops
            if name == "zeros" and isinstance(out, torch.Tensor):
                self.trace.events.append(Op(name, (), (self.node(out),), _simplify(args), {}))
            return out
        outs = _tensors(out, []) or (ins[:1] if name == "setitem" else [])  # x[i] = v returns nothing: x is its output
        if not outs:
            return out
        in_ids = tuple(self.node(t) for t in ins)
        grad = any(self.trace.needs_grad[i] for i in in_ids)
        out_ids = []
        for t in outs:
            fresh = id(t) not in self.ids or name == "setitem"
            nid = self.node(t)
            if fresh and grad and (t.is_floating_point() or t.is_complex()):
                self.trace.needs_grad[nid] = True
            out_ids.append(nid)
        self.trace.events.append(
            Op(name, in_ids, tuple(out_ids), _simplify(args), {k: _simplify(v) for k, v in kwargs.items()})
        )
        return out

    # -- modules -------------------------------------------------------------------

    def wrap(self, module: nn.Module, fqn: str):
        original = module.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            return self.call(module, fqn, original, args, kwargs)

        return forward

    def call(self, module: nn.Module, fqn: str, original, args: tuple, kwargs: dict):
        events = self.trace.events
        node_or_none = lambda v: self.node(v) if isinstance(v, torch.Tensor) else None  # noqa: E731
        events.append(Call(fqn, tuple(node_or_none(a) for a in args), {k: node_or_none(v) for k, v in kwargs.items()}))
        in_tensors = _tensors(args, [])
        _tensors(kwargs, in_tensors)
        key = self.memo_key(module, args, kwargs)
        recording = self.memo.get(key) if key is not None else None
        if recording is not None:
            out = self.replay(recording, fqn, in_tensors)
        else:
            start = len(events)
            out = original(*args, **kwargs)
            if key is not None:
                self.record(key, fqn, events[start:], in_tensors, out)
        outputs = out if isinstance(out, tuple) else (out,)
        flat = tuple(self.node(t) for t in _tensors(out, []))
        events.append(Return(fqn, tuple(node_or_none(o) for o in outputs), isinstance(out, tuple), flat))
        return out

    def memo_key(self, module: nn.Module, args: tuple, kwargs: dict):
        try:
            inputs = _input_key((args, kwargs), {})
        except TypeError:
            return None
        return (self.structures.of(module), inputs)

    def record(self, key, fqn: str, events: list, in_tensors: list, out: Any) -> None:
        meta: dict = {}

        def shape_of(value):
            if isinstance(value, torch.Tensor):
                nid = self.node(value)
                meta[nid] = (tuple(value.shape), value.dtype, value.device)
                return ("T", nid)
            if value is None:
                return None
            if isinstance(value, (tuple, list)):
                items = [shape_of(v) for v in value]
                # anything opaque inside makes the whole output opaque: replay would put None there
                return _OPAQUE if any(i is _OPAQUE for i in items) else (type(value), items)
            return _OPAQUE

        structure = shape_of(out)
        if structure is _OPAQUE:
            return  # an output we cannot rebuild (a dataclass, a cache): always run this module
        self.memo[key] = _Recording(fqn, events, [self.node(t) for t in in_tensors], structure, meta)

    def replay(self, recording: _Recording, fqn: str, in_tensors: list):
        trace = self.trace
        mapping = dict(zip(recording.input_nodes, (self.node(t) for t in in_tensors)))

        def node(nid: int) -> int:
            new = mapping.get(nid)
            if new is None:
                new = mapping[nid] = trace.new_node(trace.shapes[nid], trace.needs_grad[nid])
            return new

        old = recording.fqn
        rename = (lambda name: fqn + name[len(old):]) if old else (lambda name: f"{fqn}.{name}" if name else fqn)
        for nid, (owner, pname) in list(trace.params.items()):  # the replayed module's own parameters
            if owner == old or owner.startswith(old + ".") or not old:
                found = self.param_nodes.get((rename(owner), pname))
                if found is not None:
                    mapping.setdefault(nid, found)
        for event in recording.events:
            if isinstance(event, Op):
                trace.events.append(Op(event.name, tuple(map(node, event.inputs)), tuple(map(node, event.outputs)), event.args, event.kwargs))
            elif isinstance(event, Call):
                trace.events.append(Call(
                    rename(event.fqn),
                    tuple(None if a is None else node(a) for a in event.args),
                    {k: None if v is None else node(v) for k, v in event.kwargs.items()},
                ))
            else:
                trace.events.append(Return(
                    rename(event.fqn),
                    tuple(None if o is None else node(o) for o in event.outputs),
                    event.is_tuple,
                    tuple(map(node, event.flat)),
                ))

        by_node = {self.node(t): t for t in in_tensors}

        def rebuild(structure):
            if structure is None:
                return None
            if structure[0] == "T":
                nid = node(structure[1])
                if nid in by_node:  # the module returned one of its inputs
                    return by_node[nid]
                shape, dtype, device = recording.output_meta[structure[1]]
                self.replaying = True
                try:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                finally:
                    self.replaying = False
                self.bind(tensor, nid)
                by_node[nid] = tensor
                return tensor
            kind, items = structure
            return kind(rebuild(i) for i in items)

        return rebuild(recording.output)


_OPAQUE = object()


def trace_model(model: nn.Module, inputs: tuple) -> Trace:
    """The events of one forward of `model` on `inputs` (in the caller's mode: meta,
    fake or values); TraceError when
    the forward raises. The model is left exactly as it was."""
    trace = Trace()
    tracer = _Tracer(trace)
    trace.structures = tracer.structures
    patched = []
    try:
        for fqn, module in model.named_modules():
            if "forward" in vars(module):
                continue  # already patched by someone else: leave it alone (and untraced)
            module.forward = tracer.wrap(module, fqn)
            patched.append(module)
        trace.inputs = tuple(tracer.node(x) if isinstance(x, torch.Tensor) else None for x in inputs)
        tracer.parameters(model)
        with torch.no_grad(), tracer:
            model(*inputs)
    except Exception as exc:  # the user's model code: any failure is reported, not raised
        raise TraceError(_describe(exc)) from exc
    finally:
        for module in patched:
            del module.forward
    return trace


def _describe(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and not f.filename.endswith("lint/trace.py")]
    where = f" (at {user[-1].filename}:{user[-1].lineno})" if user else ""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:200]}{where}"
