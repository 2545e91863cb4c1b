"""Where each projection's output goes, from one traced forward (lint/trace.py).

`tpplan init` infers rules from the data flow, not from module names. For every
Linear (and Embedding) call it follows the output through the ops after it, and
stops at the next Linear that takes it as input: that Linear is one of the
output's *consumers*. It follows only tensors that carry a gradient (not a top-k's
indices, a mask built from them, or detached values: they select, they carry no
features), and in-place writes into a view (`copy_` into `t[..., :n]`) into its base. A projection whose only consumer is one other Linear (q, k
and v reach o_proj through heads and attention; gate and up reach down_proj
through the activation and the product) is the column half of a pair; the consumer,
whose own output goes on to many (the residual stream), is the row half.

Also read from the trace: the head split of a projection (the first view that cuts
its features into (heads, head_dim)), whether an output reaches the model's output
(the head), and which Embedding reads the model's input (the token embedding).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..lint.trace import Call, Op, Return

if TYPE_CHECKING:
    from torch import nn

    from ..lint.trace import Trace

# Ops that split the last dim into two (a head split).
_RESHAPES = {"view", "reshape", "unflatten", "view_as"}
# Ops whose output is a view of their first input: an in-place write into it writes into the base.
_VIEWS = {"getitem", "view", "reshape", "transpose", "permute", "narrow", "select", "slice", "unsqueeze", "squeeze",
          "expand", "as_strided", "flatten", "unflatten", "view_as", "t", "diagonal", "split", "chunk", "unbind"}
# How far a walk goes before giving up on a tensor (a deep model's residual stream reaches everything).
_MAX_CONSUMERS = 2


@dataclass
class Projection:
    """One projection module (an nn.Linear, a Conv1D, stacked expert Linears) over all its calls in the traced forward."""

    fqn: str
    consumers: set = field(default_factory=set)  # Linears its output reaches first (capped at _MAX_CONSUMERS + 1)
    to_output: bool = False  # its output reaches the model's output without passing another Linear
    to_stream: bool = False  # its output is added into the residual stream (a row half, never a column one)
    heads: tuple | None = None  # (heads, head_dim): the first view of its output into heads
    inputs: set = field(default_factory=set)  # node ids of its activation inputs
    calls: int = 0

    @property
    def head(self) -> bool:
        """The model's output head: its output is the model's output itself, reaching no other
        projection and not added into the residual stream (an MLP stack's last out_proj, whose
        output is summed into the stream that is the model's output, is the row half of a pair)."""
        return self.to_output and not self.consumers and not self.to_stream


@dataclass
class Dataflow:
    projections: dict  # fqn -> Projection (nn.Linear modules that ran)
    embeddings: dict  # fqn -> whether its indices are a model input (a token embedding)
    output_nodes: set
    stream: set = field(default_factory=set)  # modules that take the residual stream as an input
    calls: dict = field(default_factory=dict)  # module fqn -> its first Call event
    readers: dict = field(default_factory=dict)  # node -> the ops that take it
    outputs: dict = field(default_factory=dict)  # Linear fqn -> its output nodes (one per call)
    linear_of: dict = field(default_factory=dict)  # id(op) -> (the Linear whose call it is, its activation node)
    bases: dict = field(default_factory=dict)  # node -> the node it is a view of
    shapes: list = field(default_factory=list)  # node -> its full shape
    needs_grad: list = field(default_factory=list)  # node -> whether it carries a gradient

    def first_linears(self, node: int) -> set:
        """The Linears `node` reaches first (as their activation), through every op but a Linear."""
        return {what for kind, what, _ in _reach([node], self.readers, self.linear_of, self.bases, self.needs_grad)
                if kind == "linear"}

    def shared_input(self, fqns: list[str]) -> int | None:
        """The one tensor all of `fqns` (projections) take, when nothing else reads it."""
        nodes = {n for f in fqns for n in self.projections[f].inputs}
        if len(nodes) != 1:
            return None
        node = nodes.pop()
        return node if all(op.name == "linear" for op in self.readers.get(node, ())) else None

    def argument(self, fqn: str, node: int) -> tuple | None:
        """Where module `fqn`'s call takes `node`: (position or keyword, number of positional arguments)."""
        call = self.calls.get(fqn)
        if call is None:
            return None
        for index, arg in enumerate(call.args):
            if arg == node:
                return index, len(call.args)
        for key, arg in call.kwargs.items():
            if arg == node:
                return key, len(call.args)
        return None


def is_projection(module: "nn.Module") -> bool:
    """A module init pairs: an nn.Linear, or a kind colwise and rowwise shard that computes
    as one (transformers' Conv1D, stored [in, out]; stacked expert Linears [E, out, in])."""
    from torch import nn

    from ..core.style_table import ColwiseSpec
    from ..sharding.styles import module_kind

    return isinstance(module, nn.Linear) or module_kind(module) in ColwiseSpec.semantics.kind_classes


def features(module: "nn.Module") -> tuple[int, int]:
    """(inputs, outputs) of a projection: the dims of its weight that rowwise and colwise shard."""
    from ..core.style_table import ColwiseSpec, RowwiseSpec
    from ..sharding.styles import module_kind

    kind, shape = module_kind(module), module.weight.shape
    return shape[RowwiseSpec.semantics.contract.tp.placement(kind, "weight").dim], shape[ColwiseSpec.semantics.contract.tp.placement(kind, "weight").dim]


def _activation(op: Op, module: "nn.Module") -> int | None:
    """The activation a projection's op takes: F.linear's input (an nn.Linear's, or one
    expert's rows in stacked expert Linears), or Conv1D's `addmm(bias, x.view(-1, in),
    weight)` middle argument; None for any other op."""
    if op.name == "linear" and op.inputs and op.outputs and is_projection(module):
        return op.inputs[0]
    if op.name == "addmm" and len(op.inputs) == 3 and op.outputs and is_projection(module):
        return op.inputs[1]
    return None


def analyze(trace: "Trace", modules: "dict[str, nn.Module]") -> Dataflow:
    from torch import nn

    consumers: dict[int, list[Op]] = defaultdict(list)
    linear_of: dict[int, tuple[str, int]] = {}  # id(op) -> (Linear fqn, its activation node)
    outputs_of: dict[str, list[int]] = defaultdict(list)
    projections: dict[str, Projection] = {}
    embeddings: dict[str, bool] = {}
    model_inputs = {n for n in trace.inputs if n is not None}
    output_nodes: set = set()
    calls: dict[str, Call] = {}
    bases: dict[int, int] = {}
    stack: list[str] = []
    for event in trace.events:
        if isinstance(event, Call):
            stack.append(event.fqn)
            calls.setdefault(event.fqn, event)
            continue
        if isinstance(event, Return):
            stack.pop()
            if event.fqn == "" and not stack:
                output_nodes.update(event.flat)
            if event.fqn in projections and not isinstance(modules.get(event.fqn), nn.Linear) and event.outputs[0] is not None:
                outputs_of[event.fqn].append(event.outputs[0])  # a Conv1D's (its addmm's, viewed) or stacked Linears' (cat)
            continue
        for node in event.inputs:
            consumers[node].append(event)
        if event.name in _VIEWS and event.inputs:
            for out in event.outputs:
                if out != event.inputs[0]:
                    bases.setdefault(out, event.inputs[0])
        owner = stack[-1] if stack else ""
        module = modules.get(owner)
        activation = _activation(event, module) if module is not None else None
        if activation is not None:
            proj = projections.setdefault(owner, Projection(owner))
            proj.calls += 1
            proj.inputs.add(activation)
            linear_of[id(event)] = (owner, activation)
            if isinstance(module, nn.Linear):
                outputs_of[owner].append(event.outputs[0])
        elif event.name == "embedding" and isinstance(module, nn.Embedding) and event.inputs:
            indices = event.inputs[0]
            while indices not in model_inputs and indices in bases:  # GPT-2's input_ids.view(-1, seq)
                indices = bases[indices]
            reads_input = indices in model_inputs
            embeddings[owner] = embeddings.get(owner, False) or reads_input
            if reads_input:
                outputs_of[owner].append(event.outputs[0])
    # The stream starts where the model's input enters it: the token embedding's output; a
    # stem Linear's output where the stem is all that reads the input (a ViT's patch
    # projection); the input itself where it also flows on beside the Linears that read it,
    # into an op that keeps its shape (an MLP stack's residual add: `x + out_proj(...)`).
    flowing = {n for n in model_inputs if any(id(op) not in linear_of and any(
        trace.shapes[o] == trace.shapes[n] for o in op.outputs) for op in consumers.get(n, ()))}
    stems = [f for f, p in projections.items() if p.inputs & (model_inputs - flowing)]
    starts = [n for fqn in [*(f for f, reads in embeddings.items() if reads), *stems] for n in outputs_of[fqn]]
    starts += sorted(flowing)
    stream = _stream_nodes(starts, consumers, linear_of, trace)
    for fqn, proj in projections.items():
        _follow(proj, outputs_of[fqn], consumers, linear_of, output_nodes, trace, bases, stream)
    takers = {e.fqn for e in trace.events if isinstance(e, Call) and any(
        n in stream for n in (*e.args, *e.kwargs.values()) if n is not None)}
    return Dataflow(projections, embeddings, output_nodes, takers, calls, consumers, dict(outputs_of),
                    dict(linear_of), bases, trace.shapes, trace.needs_grad)


def _stream_nodes(starts: list[int], consumers, linear_of, trace) -> set:
    """The residual stream: the token embedding's output and every tensor of its shape an
    op makes from it (norms, residual adds), up to the projections that read it."""
    seen = set(starts)
    frontier = list(starts)
    while frontier:
        node = frontier.pop()
        for op in consumers.get(node, ()):
            if id(op) in linear_of:
                continue
            for out in op.outputs:
                if out not in seen and trace.shapes[out] == trace.shapes[node]:
                    seen.add(out)
                    frontier.append(out)
    return seen


def _written(op: Op, bases: dict) -> list[int]:
    """Where an op's data goes: its outputs and, for an in-place write into a view (`copy_`
    into `t[..., :n]`), the tensors that view is of, whose later readers see the write."""
    out = list(op.outputs)
    if op.inputs and op.inputs[0] in op.outputs and len(op.inputs) > 1:
        node = op.inputs[0]
        while node in bases:
            node = bases[node]
            out.append(node)
    return out


def _reach(starts: list[int], readers, linear_of, bases, needs_grad) -> Iterator[tuple]:
    """The walk from `starts` through every op but a Linear, following only tensors that
    carry a gradient (not a top-k's indices or detached values) and in-place writes into
    a view's base. Yields ("node", None, n) for each tensor as it is reached,
    ("linear", fqn, n) when the Linear `fqn` takes n as its activation (its output is its
    own: not followed), and ("op", op, n) for each other op that reads n."""
    seen, frontier = set(starts), list(starts)
    while frontier:
        node = frontier.pop()
        yield "node", None, node
        for op in readers.get(node, ()):
            hit = linear_of.get(id(op))
            if hit is not None:
                if hit[1] == node:
                    yield "linear", hit[0], node
                continue
            yield "op", op, node
            for out in _written(op, bases):
                if out not in seen and needs_grad[out]:
                    seen.add(out)
                    frontier.append(out)


def _follow(proj: Projection, starts: list[int], consumers, linear_of, output_nodes, trace, bases, stream) -> None:
    first = set(starts)
    for kind, what, node in _reach(starts, consumers, linear_of, bases, trace.needs_grad):
        if kind == "node":
            if len(proj.consumers) > _MAX_CONSUMERS:
                break
            proj.to_output |= node in output_nodes
            proj.to_stream |= node in stream and node not in first
        elif kind == "linear":
            proj.consumers.add(what)
        elif proj.heads is None and what.name in _RESHAPES and node in first:
            proj.heads = _head_split(trace.shapes[node], [trace.shapes[o] for o in what.outputs],
                                     lambda: _cut_size(what.outputs[0], consumers, linear_of, trace))


def _head_split(shape: tuple, outs: list, cut=lambda: None) -> tuple | None:
    """(heads, head_dim) when a view cuts the last dim of `shape` into two, or into three
    (a fused projection: its blocks and heads in either order, then head_dim). Of three,
    the blocks are the size the ops after the view cut apart (`cut()`): bloom's
    `(heads, 3, head_dim)` indexed `[..., 0, :]`, a ViT's `(3, heads, head_dim)` unbound;
    blocks first when nothing says (or both sizes are equal)."""
    if len(outs) != 1 or not shape:
        return None
    out, lead = outs[0], len(shape) - 1
    if tuple(out[:lead]) != tuple(shape[:-1]):
        return None
    tail = tuple(out[lead:])
    if len(tail) not in (2, 3) or _product(tail) != shape[-1]:
        return None
    if len(tail) == 3 and tail[0] != tail[1] and cut() == tail[1]:
        tail = (tail[0], tail[2])  # (heads, blocks, head_dim)
    return tail[-2:] if all(d > 1 for d in tail[-2:]) else None


def _cut_size(node: int, readers, linear_of, trace, depth: int = 4) -> int | None:
    """The size of the one dim that the first op cutting `node` apart removes (indexing,
    select, unbind; or chunks it into size 1), following views and permutes up to `depth` ops."""
    from collections import Counter

    frontier = [node]
    for _ in range(depth):
        following = []
        for n in frontier:
            for op in readers.get(n, ()):
                if id(op) in linear_of:
                    continue
                for out in op.outputs:
                    removed = Counter(trace.shapes[n]) - Counter(trace.shapes[out])
                    added = Counter(trace.shapes[out]) - Counter(trace.shapes[n])
                    if sum(removed.values()) == 1 and set(added) <= {1}:
                        return next(iter(removed))
                    if _product(trace.shapes[out]) == _product(trace.shapes[n]):
                        following.append(out)  # the same values rearranged: a view or a permute
        frontier = following
    return None


def _product(dims: tuple) -> int:
    out = 1
    for d in dims:
        out *= d
    return out
