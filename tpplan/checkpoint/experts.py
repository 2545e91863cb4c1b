"""Per-expert checkpoint keys into fused 3-D expert parameters.

transformers 5 holds routed experts fused (`experts.gate_up_proj [E, 2I, H]` =
[gate; up] per expert, `experts.down_proj [E, H, I]`), but its `save_pretrained`
converts them back to the per-expert keys of the original checkpoints (its
conversion mapping; `from_pretrained` fuses them again):

- Qwen3-MoE / Qwen2-MoE / OLMoE: `experts.{e}.gate_proj.weight [I, H]`,
  `experts.{e}.up_proj.weight`, `experts.{e}.down_proj.weight [H, I]`;
- Mixtral: `block_sparse_moe.experts.{e}.w1.weight` (gate), `.w3` (up), `.w2` (down)
  (the module is `mlp.experts` in the model);
- gpt-oss is written fused, as the model holds it (nothing to map).

The mapping is read from transformers' own conversion mapping for the model
(`conversions`: its renamings, and its per-expert merges that stack on a new
expert dim and concatenate gate/up on dim 1), not a table of our own.
`fused_parts` says which checkpoint keys fill a fused parameter and where; the
loader then gives torch's reader one target per key: a view into this rank's
local shard, a `Shard` DTensor when the key is split over the mesh (expert TP:
each rank reads its rows of every expert's gate, up and down), a plain tensor
when the rank holds that expert whole (expert parallel; the other ranks' experts
are not read at all). A packed `_StridedShard` gate/up shard is thereby read as
two plain-sharded halves, which torch's load planner handles.

A fused packed shard read or written as one key (a DCP checkpoint of an
`expert_tp` model) goes through `PackedShardState` and the two planners below:
torch 2.13 computes one contiguous chunk per rank for a `_StridedShard` DTensor,
which overlaps the other ranks' (its DCP save failed with TP608).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

@dataclass(frozen=True)
class Part:
    """Checkpoint `key` holds fused[expert, block * size:(block + 1) * size] (dim 1)."""

    key: str
    expert: int
    block: int
    blocks: int


@dataclass
class Conversions:
    """What transformers' conversion mapping for a model says about checkpoint keys:
    renamings (Mixtral's `.block_sparse_moe.` -> `.mlp.`) and per-expert merges
    (`.experts.*.w1.weight` + `.experts.*.w3.weight` -> `.experts.gate_up_proj`)."""

    renamings: list = field(default_factory=list)
    merges: list[tuple[str, list[str]]] = field(default_factory=list)  # (target suffix, source patterns with *)

    def model_key(self, key: str) -> str:
        for renaming in self.renamings:
            key = renaming.rename_source_key(key)[0]
        return key


def conversions(model: "nn.Module") -> Conversions:
    """transformers' conversion mapping of `model` (none for other models), keeping only
    what this loader does exactly: renamings, and per-expert stacks along a new expert
    dim 0 optionally concatenated on dim 1 (anything else stays unmapped, and its keys
    are reported missing/unexpected)."""
    if not (hasattr(model, "config") and type(model).__module__.startswith("transformers.")):
        return Conversions()
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings: keys are taken as they are
        return Conversions()
    out = Conversions()
    for transform in get_model_conversion_mapping(model):
        if type(transform) is WeightRenaming:
            out.renamings.append(transform)
        elif type(transform) is WeightConverter and len(transform.target_patterns) == 1:
            ops = list(transform.operations)
            merge = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            concat = len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
            sources = list(transform.source_patterns)
            if merge and concat and all(src.count("*") == 1 for src in sources) and (len(ops) == 2 or len(sources) == 1):
                out.merges.append((transform.target_patterns[0], sources))
    return out


def fused_parts(name: str, shape: tuple[int, ...], keys: dict[str, str], conv: Conversions) -> list[Part] | None:
    """The checkpoint keys that together hold the fused expert parameter `name`
    (shape [E, N, M]), or None when the checkpoint does not hold it per expert.
    `keys`: {the checkpoint key as the model names it: the checkpoint key}."""
    if len(shape) != 3:
        return None
    for target, sources in conv.merges:
        target, sources = target.lstrip("."), [src.lstrip(".") for src in sources]
        if name != target and not name.endswith("." + target):
            continue
        prefix = name[: len(name) - len(target)]
        renamed = [[prefix + src.replace("*", str(e)) for src in sources] for e in range(shape[0])]
        if all(k in keys for per in renamed for k in per):
            return [Part(keys[k], e, b, len(sources)) for e, per in enumerate(renamed) for b, k in enumerate(per)]
    return None


def part_shape(shape: tuple[int, ...], part: Part) -> tuple[int, ...]:
    """The checkpoint shape of one part of a fused [E, N, M] parameter: [N / blocks, M]."""
    return (shape[1] // part.blocks, shape[2])


def part_targets(t: "torch.Tensor", parts: list[Part], where: str) -> dict[str, "torch.Tensor"]:
    """{checkpoint key: tensor to fill} for this rank: views into `t`'s local storage."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from .errors import fail

    shape = tuple(t.shape)
    if not isinstance(t, DTensor):
        return {p.key: _block(t[p.expert], p, shape[1] // p.blocks) for p in parts}
    if t.device_mesh.ndim != 1:
        raise fail("TP603", f"per-expert checkpoint keys into a {t.device_mesh.ndim}-D mesh are not supported yet", where)
    placement, mesh = t.placements[0], t.device_mesh
    local = t.to_local()
    n, rank = mesh.size(), mesh.get_coordinate()[0]  # the coordinate, not the group: a simulated rank has no group of its own
    out = {}
    if isinstance(placement, Replicate):
        return {p.key: _block(local[p.expert], p, shape[1] // p.blocks) for p in parts}
    if isinstance(placement, _StridedShard) or (isinstance(placement, Shard) and placement.dim % 3 != 0):
        dim = placement.dim % 3
        strided = isinstance(placement, _StridedShard)
        for p in parts:
            full = list(part_shape(shape, p))
            if dim == 1 and p.blocks > 1 and not (strided and placement.split_factor == p.blocks):
                raise fail("TP603", f"{p.key}: a plain shard of a packed gate/up dim cannot be read per expert", where)
            if shape[dim] % (n * (p.blocks if dim == 1 else 1)):
                raise fail("TP603", f"{p.key}: dim {dim} of size {shape[dim]} does not split evenly over {n} ranks", where)
            piece = local[p.expert]
            if dim == 1:  # rank's rows of block b: local rows [b * rows, (b + 1) * rows)
                piece = _block(piece, p, shape[1] // (p.blocks * n))
            else:
                piece = _block(piece, p, shape[1] // p.blocks)
            out[p.key] = DTensor.from_local(
                piece, mesh, [Shard(dim - 1)], run_check=False, shape=tuple(full), stride=(full[1], 1)
            )
        return out
    if isinstance(placement, Shard):  # the expert dim: whole experts on this rank
        per = shape[0] // n
        if shape[0] % n:
            raise fail("TP603", f"{shape[0]} experts do not divide over {n} ranks", where)
        for p in parts:
            if rank * per <= p.expert < (rank + 1) * per:
                out[p.key] = _block(local[p.expert - rank * per], p, shape[1] // p.blocks)
        return out
    raise fail("TP603", f"per-expert checkpoint keys into placement {placement} are not supported", where)


def _block(t: "torch.Tensor", part: Part, rows: int) -> "torch.Tensor":
    return t[part.block * rows:(part.block + 1) * rows]


class PackedShardState:
    """A packed `_StridedShard(d, split_factor=s)` DTensor as torch.distributed.checkpoint
    sees it: `s` plain chunks per rank (rank r of the packed mesh dim holds rows
    [b * size/s + r * c, + c) of dim d for each block b, c = size / (s * n)) instead of
    the one chunk torch 2.13's `compute_local_shape_and_global_offset` gives it (which
    overlaps the other ranks' and makes a DCP save fail, or a load put rows in the wrong
    place). Save and load both use it, so the fused tensor is written whole and reads back
    at any degree or layout. On a mesh of several dims (FSDP2 or HSDP over the data dims
    beside TP's), the other dims' plain placements cut the other tensor dims as torch cuts
    them (`packed_dim`: they must not cut dim d)."""

    def __init__(self, tensor: "torch.Tensor"):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh_dim = packed_dim(tensor)
        if mesh_dim is None:
            raise ValueError("PackedShardState needs a DTensor with one _StridedShard placement, on a dim no other placement cuts")
        placement = tensor.placements[mesh_dim]
        self.tensor = tensor
        self.dim = placement.dim % tensor.dim()
        self.blocks = placement.split_factor
        n, self.rank = tensor.device_mesh.size(mesh_dim), tensor.device_mesh.get_coordinate()[mesh_dim]
        self.block_size = tensor.shape[self.dim] // self.blocks
        self.chunk = self.block_size // n
        plain = [Replicate() if i == mesh_dim else p for i, p in enumerate(tensor.placements)]
        _, self.base = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, plain)  # the other dims' offsets
        self.local = tensor._local_tensor  # to_local() of a parameter is an autograd view: no in-place reads into it

    def size(self) -> "torch.Size":
        return self.tensor.size()

    def _offsets(self, block: int) -> "torch.Size":
        import torch

        offsets = list(self.base)
        offsets[self.dim] = block * self.block_size + self.rank * self.chunk
        return torch.Size(offsets)

    def _piece(self, block: int) -> "torch.Tensor":
        return self.local.narrow(self.dim, block * self.chunk, self.chunk)

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self._offsets(b), sizes=self._piece(b).size()) for b in range(self.blocks)]

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        items = []
        for b in range(self.blocks):
            offsets, piece = self._offsets(b), self._piece(b)
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.size()),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=self.tensor.size(),
                ),
            ))
        return items

    def __get_tensor_shard__(self, index) -> "torch.Tensor":
        for b in range(self.blocks):
            if index.offset is None or self._offsets(b) == index.offset:
                return self._piece(b)
        raise ValueError(f"{index.fqn}: no packed chunk of this rank at offset {tuple(index.offset)}")


def packed_dim(t: Any) -> int | None:
    """The mesh dim of a plan's packed shard: the one `_StridedShard` placement of DTensor
    `t`, on a tensor dim no other placement cuts (FSDP2 over the data dims shards another
    dim); None for anything else (FSDP2's own `_StridedShard`s, of a dim TP already
    shards, are torch's planner's to save as they are)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return None
    strided = [i for i, p in enumerate(t.placements) if isinstance(p, _StridedShard)]
    if len(strided) != 1:
        return None
    dim = t.placements[strided[0]].dim % t.dim()
    cut = [p.dim % t.dim() for i, p in enumerate(t.placements) if i != strided[0] and isinstance(p, Shard)]
    return None if dim in cut else strided[0]


def checkpoint_view(t: "torch.Tensor"):
    """What torch.distributed.checkpoint is given for `t`: a PackedShardState for a packed
    shard, `t` itself otherwise."""
    return PackedShardState(t) if packed_dim(t) is not None else t


def checkpoint_views(state: Any) -> Any:
    """`checkpoint_view` of every tensor of a nested state (an optimizer's: dicts and
    lists), as a new tree; the tensors themselves are shared, so a load fills them."""
    if isinstance(state, dict):
        return {key: checkpoint_views(value) for key, value in state.items()}
    if isinstance(state, list):
        return [checkpoint_views(value) for value in state]
    return checkpoint_view(state)


def optimizer_views(held: dict) -> dict:
    """What DCP is given for a training checkpoint's extra state (training/state.py's
    `state_for_save` or `targets_for_load`): the optimizer's moments as the checkpoint
    stores them (a packed one as its plain chunks, read into the moment in place), the
    rest the same objects (DCP fills the extra's dict); the caller keeps `held`."""
    from .training.state import RESERVED

    inner = held.get(RESERVED)
    if inner is None or "optimizer" not in inner:
        return held
    return {RESERVED: {**inner, "optimizer": checkpoint_views(inner["optimizer"])}}


def _lookup(state: dict, index, default):
    obj = state.get(index.fqn)
    if isinstance(obj, PackedShardState):  # torch's lookup takes only tensors by offset
        return obj.__get_tensor_shard__(index)
    return default(index)


def save_planner():
    """torch's DefaultSavePlanner, finding a PackedShardState's chunks."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class PackedSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            return _lookup(self.state_dict, index, super().lookup_object)

    return PackedSavePlanner()


def load_planner(mappable=frozenset(), **kwargs):
    """torch's DefaultLoadPlanner, reading into a PackedShardState's chunks.
    `mappable`: the keys whose targets the reader may make views of the file
    (freshly allocated local tensors: `mapped.whole_target`)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class PackedLoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            # torch's _init_state_dict replaces objects it does not know with None: keep ours,
            # nested ones (the optimizer's) under their flattened keys, as torch looks them up
            packed = {k: v for k, v in state_dict.items() if isinstance(v, PackedShardState)}
            nested = {k: v for k, v in flatten_state_dict(state_dict)[0].items() if isinstance(v, PackedShardState)}
            super().set_up_planner(state_dict, metadata, is_coordinator)
            state_dict.update(packed)
            self.state_dict.update(nested)

        def lookup_tensor(self, index):
            return _lookup(self.state_dict, index, super().lookup_tensor)

    planner = PackedLoadPlanner(**kwargs)
    planner.mappable = frozenset(mappable)
    return planner
