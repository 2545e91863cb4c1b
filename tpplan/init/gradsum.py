"""`sum_output_grad` for a projection left whole whose output, or its last features,
meets a pair's sharded heads as it is.

The case: an MLA attention's `kv_a_proj_with_mqa` returns [kv latent; rotary key]. The
latent goes through the colwise `kv_b_proj` (a producer of the pair), whose input
gradient torch already sums over the mesh; the rotary key bypasses it and meets each
rank's own heads (reaching the pair's rowwise `o_proj` without another Linear), so
each rank's gradient of it is its share. Summing the whole output's gradient would
count the latent's `tp` times; `last: N` sums the rotary key's N features only.

Read from the traced forward (dataflow.py): the op that cuts the projection's output on
its last dim into pieces (split, chunk), and the Linears each piece reaches first. A
piece that reaches only the pair's colwise producers has its gradient summed already;
a piece that reaches the pair's row half needs the sum. Those must be the output's
tail (`last` counts from the end).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .dataflow import Dataflow, features

if TYPE_CHECKING:
    from torch import nn

_CUTS = {"split", "split_with_sizes", "chunk", "tensor_split", "unsafe_split"}


def shared_tails(modules: "dict[str, nn.Module]", flow: Dataflow, consumer: str, prods: list[str],
                 claimed: set) -> dict[str, int]:
    """{projection: how many of its last output features need the sum} for each Linear
    left whole whose output reaches the pair (`prods` colwise -> `consumer` rowwise) and
    meets its heads: that count is the whole width when all of the output does."""
    out = {}
    for fqn, proj in flow.projections.items():
        if fqn in claimed or fqn in prods or fqn == consumer or consumer not in proj.consumers:
            continue
        if proj.to_output or not proj.consumers <= {consumer, *prods}:
            continue  # it feeds more than this pair: not only its heads
        tail = _tail(flow, fqn, features(modules[fqn])[1], consumer, set(prods))
        if tail is not None:
            out[fqn] = tail
    return out


def _tail(flow: Dataflow, fqn: str, width: int, consumer: str, prods: set) -> int | None:
    found = None
    for node in flow.outputs.get(fqn, ()):
        pieces = _pieces(flow, node, width)
        if pieces is None:
            reached = flow.first_linears(node)
            tail = width if reached == {consumer} else None  # used whole: all of it, unless it also feeds a producer
        else:
            shared = []
            for piece, _ in pieces:
                reached = flow.first_linears(piece)
                if consumer in reached:
                    shared.append(True)
                elif reached and reached <= prods:
                    shared.append(False)
                else:
                    return None  # a piece that goes elsewhere (or nowhere a Linear is): no verdict
            if True not in shared:
                return None
            first = shared.index(True)
            if not all(shared[first:]):
                return None  # the shared features are not the output's tail: `last` cannot say
            tail = sum(w for _, w in pieces[first:])
        if tail is None or found not in (None, tail):
            return None
        found = tail
    return found


def _pieces(flow: Dataflow, node: int, width: int) -> list[tuple[int, int]] | None:
    """(node, width) of each piece, in order, when one op cuts `node` on its last dim
    and nothing else reads it; None when it is read otherwise."""
    readers = flow.readers.get(node, [])
    if len(readers) != 1 or readers[0].name not in _CUTS:
        return None
    shapes = flow.shapes
    outs = readers[0].outputs
    if len(outs) < 2 or any(tuple(shapes[o][:-1]) != tuple(shapes[node][:-1]) for o in outs):
        return None
    if sum(shapes[o][-1] for o in outs) != width:
        return None
    return [(o, shapes[o][-1]) for o in outs]
