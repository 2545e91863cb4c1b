"""What tensor ops do to a shard: the op models of the layout flow (flow.py).

Between modules, ops carry shards along the dims they map: views, transposes,
elementwise ops with broadcasting, attention, reductions over other dims. An op
that needs what a plain shard lacks (reducing over the sharded dim, mixing it
with a full tensor) is a `Leak`; an op not modelled here makes the layout
unknown, and nothing after it is judged. A fused projection's shard cut into
kinds (q, k, v) along its sharded dim is a `Fused` finding, unless the
projection is a packed colwise whose blocks the cut follows. Partial sums are
partial.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .layouts import Fused, Lay, Leak
from .trace import Op

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
FRESH = frozenset({"new_empty", "new_zeros", "new_ones", "new_full"})  # x.new_zeros(...): x lends dtype and device
SHAPE_ONLY_OTHERS = frozenset({"type_as", "to", "view_as", "reshape_as", "expand_as"}) | FRESH
SPLITS = frozenset({"chunk", "split", "tensor_split", "unbind", "split_with_sizes"})
CATS = frozenset({"cat", "concat", "concatenate", "stack"})
SORTS = frozenset({"topk", "sort", "argsort"})  # along one dim; topk's is its third argument


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
    """Where a (contiguous) shard of `dim` goes, staying contiguous, when a tensor of
    shape `src` is viewed as `dst`; None where it does not stay a plain shard."""
    moved = _view_shard(src, dst, dim)
    return moved[0] if moved is not None and moved[1] == 1 else None


def _view_shard(src: tuple, dst: tuple, dim: int, split: int = 1) -> tuple[int, int] | None:
    """(dim, split) of a local shard of `dim` (strided in `split` groups, `Lay.split`)
    once a tensor of shape `src` is viewed as `dst`: what each rank's local view holds.

    Dims are matched in groups of equal products. A contiguous shard of the outermost
    non-trivial dim of a group stays contiguous on the outermost non-trivial dim of the
    matching group (heads split out of features, features merged back). Merged behind
    dims of `outer` elements (batch and a sharded sequence flattened into tokens), each
    rank's local view holds its block in each of the `outer` groups: a strided shard,
    as DTensor's _StridedShard(split_factor=outer) says (DTensor's own view of a Shard
    would redistribute instead; a local tensor just views its rows). Split back into
    dims whose leading ones make up the `split` groups, it is a contiguous shard of the
    next dim again. A shard of a dim merged in front of others it is interleaved with
    (head_dim before heads), or a strided one cut any other way: None.
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
            if dim not in outer_src or not outer_dst:
                return None  # a shard of a dim of size 1 (nothing to cut), or a group of ones
            if outer_src[0] != dim:  # dims merged in front of the shard's: its blocks strided
                return (outer_dst[0], math.prod(src[d] for d in outer_src[:outer_src.index(dim)]) * split) if len(outer_dst) == 1 else None
            if split == 1 or len(outer_dst) == 1:
                return outer_dst[0], split
            groups = 1
            for d in outer_dst:  # the leading dims that make up the groups, then the shard's
                if groups == split:
                    return d, 1
                groups *= dst[d]
            return None
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


def _picks_one(index: Any, ndim: int, dim: int) -> bool:
    """Whether basic index `index` picks one entry (an int) of dim `dim`."""
    items = index if isinstance(index, tuple) else (index,)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (ndim - len(items) + 1) + items[at + 1:]
    items = [item for item in items if item is not None]
    return dim < len(items) and isinstance(items[dim], int) and not isinstance(items[dim], bool)


def _packable(value: Lay) -> bool:
    """Whether the shard comes from a style that can pack its output (colwise's `packed`):
    only there is a cut along the sharded dim a fused projection's."""
    return value.src is not None and "packed" in getattr(type(value.src.rule.spec), "model_fields", {})


class OpSemantics:
    """Output layouts of ops on plain inputs, some of them sharded or partial."""

    def __init__(self, shape: Callable[[int], tuple], where: Callable[[], str], uniform: Callable[[int], frozenset] = lambda node: frozenset(),
                 partial: Callable = lambda op, values, count: None):
        self.shape = shape  # node id -> full shape
        self.where = where  # () -> the module the op runs in
        self.uniform = uniform  # node id -> the dims of a replicated tensor expanded from size 1 (a broadcast)
        self.partial = partial  # (op, values, output count) -> the outputs' layouts where some values are partial sums (partial.py)

    def leak(self, value: Lay, where: str, op: Op, node: int, against: tuple | None = None) -> Leak:
        return Leak(value, where, self.where(), op.name, self.shape(node), against)

    def semantics(self, op: Op, values: list[Lay]) -> "list[Lay] | Leak | Fused | None":
        """Output layouts of an op on plain inputs, some sharded or partial; a Leak when
        the op needs what the shard lacks; None when we do not model it."""
        name = op.name
        shapes = [self.shape(n) for n in op.inputs]
        if name in SHAPE_ONLY_OTHERS:
            # type_as(x, other), view_as(x, other): `other` lends a dtype or a shape, not values
            values, shapes = values[:1], shapes[:1]
            if values[0].kind == "R":
                return [values[0]] * len(op.outputs)
            if name in FRESH and values[0].kind == "S":
                # A fresh tensor of one value (or none): shaped like the shard along its dim, it is
                # that rank's piece (sizes read from the local shard); were its sizes the full
                # ones instead, whatever meets the shard fails on shapes, loudly, in the dry run.
                dim, out = values[0].dim, [self.shape(n) for n in op.outputs]
                same = all(len(o) == len(shapes[0]) and o[dim] == shapes[0][dim] for o in out)
                return [Lay("S", False, dim, values[0].src, split=values[0].split)] * len(out) if same else None
        first = values[0]
        out_shapes = [self.shape(n) for n in op.outputs]
        if not out_shapes:
            return []
        sharded = [(i, v) for i, v in enumerate(values) if v.kind != "R"]
        if any(v.kind == "P" for _, v in sharded):
            return self.partial(op, values, len(out_shapes))

        if name in ("max", "min") and len(op.inputs) > 1:
            return self.elementwise(op, values, shapes, out_shapes)  # torch.min(x, other): per element
        if name in ELEMENTWISE or (name in ("softmax", "log_softmax", "layer_norm", "rms_norm") and self.keeps_dim(op, values, shapes)):
            return self.elementwise(op, values, shapes, out_shapes)
        if name in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
            return self.leak(sharded[0][1], "reduce", op, op.inputs[sharded[0][0]])
        if len(sharded) != 1 or sharded[0][0] != 0 or name in CATS:
            return self.multi(op, values, shapes, out_shapes)
        if first.kind == "S" and _packable(first) and first.split == 1:
            cut = self.kinds(op, first, shapes[0], out_shapes)
            if cut is not None:
                return cut
        dim, src, shape = first.dim, first.src, shapes[0]
        out = out_shapes[0]
        moved: int | None = None
        split = first.split
        if name in VIEWS:
            viewed = _view_shard(shape, out, dim, split) if math.prod(shape) == math.prod(out) else None
            moved, split = viewed if viewed is not None else (None, split)
        elif name in EXPANDS:
            new = dim + len(out) - len(shape)
            moved = new if out[new] == shape[dim] else None
        elif name in ("view_as_complex", "view_as_real"):
            # (..., 2) real pairs <-> complex (rotary embeddings): the last dim goes or comes
            moved = dim if dim < len(shape) - (name == "view_as_complex") else None
        elif name == "repeat":
            reps = op.args[1:] if len(op.args) > 1 and not isinstance(op.args[1], tuple) else (op.args[1] if len(op.args) > 1 else ())
            new = dim + len(out) - len(shape)
            moved = new if len(reps) == len(out) and reps[new] == 1 else None
        elif name == "repeat_interleave":
            # Each element repeated in place along `dim` (GQA's KV heads): a shard of that
            # dim, or of another, stays a contiguous shard of the result.
            reps, along = _arg(op, 1, "repeats"), _dims(_arg(op, 2, "dim"), len(shape))
            moved = dim if isinstance(reps, int) and along is not None else None
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
        elif name in SORTS:
            # along another dim (a router's top-k experts of each token): each rank's rows, sorted
            along = _dims(_arg(op, 2 if name == "topk" else 1, "dim", -1), len(shape))
            moved = dim if along is not None and along[0] != dim else None
        elif name == "setitem":
            # x[index] = value: a shard stays one where the index keeps its dim and the value
            # is the same everywhere (a number, or a replicated one-element tensor)
            rest = [i for i in range(1, len(values)) if math.prod(shapes[i]) != 1]
            moved = dim if not rest and _index_dim(_arg(op, 1, "index"), shape, dim) is not None else None
        elif name in ("linear", "embedding"):
            if name == "linear" and dim == len(shape) - 1:
                return None  # contracting a shard with a full weight (an unplanned Linear reports it)
            moved = dim
        if moved is None or not all(len(s) > moved and s[moved] != 1 for s in out_shapes):
            return None
        return [Lay("S", False, moved, src, first.blocks, split)] * len(out_shapes)

    def kinds(self, op: Op, first: Lay, shape: tuple, out_shapes: list[tuple]) -> "list[Lay] | Fused | None":
        """An op that cuts a fused projection's shard along its sharded dim into kinds
        (chunk, split, unbind, indexing; a view splitting out the blocks of a packed one).
        A plain shard: a Fused finding (each rank's slice mixes kinds). A packed one: each
        kind's shard when the cut follows its blocks, else a Fused finding. None: the op
        does not cut the sharded dim."""
        name, dim, blocks = op.name, first.dim, first.blocks
        fused = lambda where, pieces=None: Fused(first, self.where(), name, shape, where, pieces)  # noqa: E731
        if name in SPLITS:
            along = _dims(_arg(op, 2 if name != "unbind" else 1, "dim", 0), len(shape))
            if along is None or along[0] != dim:
                return None
            pieces = tuple(s[dim] for s in out_shapes) if name != "unbind" else (1,) * len(out_shapes)
            if blocks is None:
                return fused("split", pieces)
            return [Lay("S", False, dim, first.src)] * len(out_shapes) if pieces == blocks else fused("slice", pieces)
        if name == "getitem":
            index = _arg(op, 1, "index")
            if _index_dim(index, shape, dim) is not None:
                return None
            picks = _picks_one(index, len(shape), dim)  # qkv[0] of (3, ...): one of shape[dim] kinds
            return fused("split" if blocks is None else "slice", (1,) * shape[dim] if picks else None)
        if name in VIEWS and blocks is not None:
            out = out_shapes[0]
            moved = _view_dim(shape, out, dim) if math.prod(shape) == math.prod(out) else None
            if moved is not None and out[moved] == shape[dim]:
                return [Lay("S", False, moved, first.src, blocks)]  # the packed dim stays whole
            inner = next((d for d in range(moved + 1, len(out)) if out[d] != 1), None) if moved is not None else None
            if inner is not None and out[moved] == len(blocks) and len(set(blocks)) == 1:
                return [Lay("S", False, inner, first.src)]  # (blocks, heads, head_dim): each rank's heads of every kind
            return fused("view")
        return None

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
        aligned: set[tuple[int, int]] = set()
        shard_index = None
        for i, v in enumerate(values):
            if v.kind == "S":
                aligned.add((v.dim + len(out) - len(shapes[i]), v.split))
                # the most recently made shard names the source: the rule that last touched it
                if shard_index is None or op.inputs[i] > op.inputs[shard_index]:
                    shard_index = i
        if len(aligned) != 1:
            return self.leak(values[shard_index], "op", op, op.inputs[shard_index])  # two shards of different dims meet
        dim, split = aligned.pop()
        if not 0 <= dim < len(out):
            return None
        for i, v in enumerate(values):
            if v.kind == "R":
                j = dim - (len(out) - len(shapes[i]))
                if 0 <= j < len(shapes[i]) and shapes[i][j] != 1 and j not in self.uniform(op.inputs[i]):  # a full tensor meets the shard
                    return self.leak(values[shard_index], "op", op, op.inputs[shard_index], (op.inputs[i], j))
        if not all(s == out for s in out_shapes):
            return None
        return [Lay("S", False, dim, values[shard_index].src, values[shard_index].blocks, split)] * len(out_shapes)

    def multi(self, op: Op, values: list[Lay], shapes: list[tuple], out_shapes: list[tuple]) -> "list[Lay] | Leak | None":
        """Ops with several inputs or the shard not first: matmul, attention, cat, stack."""
        name = op.name
        shards = [(i, v) for i, v in enumerate(values) if v.kind == "S"]
        src = shards[0][1].src
        if any(v.split != 1 for _, v in shards):  # a strided shard's rows in a product or a cat: not modelled
            return self.elementwise(op, values, shapes, out_shapes) if name in ELEMENTWISE else None
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
        if name in CATS:
            # torch.cat skips a 1-D empty tensor (transformers' DynamicCache starts from `torch.tensor([])`)
            pieces = [i for i, s in enumerate(shapes) if name == "stack" or tuple(s) != (0,)]
            if not pieces or not all(len(shapes[i]) == len(shapes[pieces[0]]) for i in pieces):
                return None
            ndim = len(shapes[pieces[0]])
            along = _arg(op, 1, "dim", 0)
            dims = {v.dim for _, v in shards}
            if len(dims) != 1 or not isinstance(along, int):
                return None
            dim = dims.pop()
            along = along % (ndim + 1 if name == "stack" else ndim)
            full = [i for i in pieces if values[i].kind == "R"]
            full = [i for i in full if (name != "stack" and along == dim) or shapes[i][dim] != 1]
            if full:
                # a whole tensor beside a shard of it: the local result is neither the whole cat nor a shard of it
                return self.leak(shards[0][1], "op", op, op.inputs[shards[0][0]], (op.inputs[full[0]], dim))
            if name != "stack" and along == dim:
                if any(values[i].kind != "S" or values[i].blocks is not None for i in pieces):
                    return None
                # each rank's shard of every piece, one after the other: a packed shard whose blocks are the pieces
                return [Lay("S", False, dim, src, tuple(shapes[i][dim] for i in pieces))]
            return [Lay("S", False, dim + (1 if name == "stack" and along <= dim else 0), src)]
        if name in ELEMENTWISE:
            return self.elementwise(op, values, shapes, out_shapes)
        return None  # not modelled: the shard's fate is unknown, nothing after it is judged

    @staticmethod
    def broadcasts(shape: tuple, ndim: int, dim: int) -> bool:
        j = dim - (ndim - len(shape))
        return j < 0 or shape[j] == 1
