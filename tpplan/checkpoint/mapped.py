"""Zero-copy loading: local tensors that are views of the safetensors file.

safetensors opens a file by mapping it into memory privately (`mmap`
`MAP_PRIVATE`: copy-on-write), and the tensors it returns are views of that
mapping; transformers' `from_pretrained` keeps such views as its parameters,
so a page is read from disk when the model first uses it, not during the load.
The HuggingFace reader (`source.py`) does the same for a read request when

- the bytes it needs are one contiguous range of the file: the stored tensor
  whole, or whole rows of it (a replicated tensor, a shard on dim 0), and
- its target is a whole local tensor that `load_checkpoint` has just allocated
  for it (the planner's `mappable` keys), on the CPU, contiguous, in the
  checkpoint's dtype:

then the target's storage becomes the file view (`Tensor.set_`): a DTensor
keeps its mesh, placements, shape and stride (only its local tensor's storage
changes), a tied parameter stays one object, nothing is copied. Everything
else is copied by the reader: a dtype conversion, a shard on another dim, a
packed or fused-expert target (a view into a bigger tensor), a target on an
accelerator, a tensor that was already materialized (it may be aliased), and
DCP checkpoints.

Lifetime: the mapping lives as long as a tensor views it (torch's storage
reference count; safetensors unmaps the file when the last view goes). Writes
(an optimizer step) land on private copies of the pages, never in the file.

Known risk, the same as transformers' and safetensors': a file truncated while
it is mapped makes the first use of a page past its new end fail with SIGBUS,
and a file rewritten in place may show its new bytes in pages not read yet.
`save_checkpoint` therefore copies a model's tensors out of the files it is
about to overwrite (`release`); do not truncate or rewrite a checkpoint
elsewhere while a model loaded from it is alive.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


def contiguous_rows(request, stored_shape) -> bool:
    """Whether `request` (a DCP ReadItem) reads one contiguous byte range of the
    stored tensor: every dim but the first whole."""
    offsets, lengths = list(request.storage_offsets), list(request.lengths)
    return not any(offsets[1:]) and lengths[1:] == list(stored_shape)[1:]


def whole_target(planner, request, dtype: "torch.dtype") -> "torch.Tensor | None":
    """The local tensor `request` fills, when it may become a view of the file (see
    the module docstring); None when the request must be copied."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    fqn = request.dest_index.fqn
    if fqn not in getattr(planner, "mappable", ()):
        return None
    obj = getattr(planner, "state_dict", {}).get(fqn)
    local = obj._local_tensor if isinstance(obj, DTensor) else obj  # to_local() of a parameter is a view of it
    if type(local) not in (torch.Tensor, nn.Parameter):  # a LocalTensor, FakeTensor, PackedShardState, ...
        return None
    if local.device.type != "cpu" or local.dtype != dtype or not local.is_contiguous() or local.storage_offset() != 0:
        return None
    if local.untyped_storage().nbytes() != local.numel() * local.element_size():  # a view into something bigger
        return None
    if any(request.dest_offsets) or list(request.lengths) != list(local.shape):
        return None
    return local


def adopt(local: "torch.Tensor", view: "torch.Tensor") -> bool:
    """Make `local` a view of the file mapping `view` is in; False, leaving `local`
    alone, when `view` does not fit exactly.

    `local` keeps what `whole_target` asked of it: a storage of exactly its bytes,
    from offset 0. Its new storage is the slice of the mapping's that holds `view`'s
    bytes (`UntypedStorage[a:b]` shares the memory and keeps the mapping alive), not
    the whole mapping at an offset: a DTensor carries its local tensor's storage
    offset, and torch's `Tensor.__deepcopy__` (DCP's async staging,
    `_create_cpu_state_dict`) takes a wrapper with a non-zero offset for one with a
    storage and fails ("invalid python storage")."""
    import torch

    if view.shape != local.shape or view.dtype != local.dtype or not view.is_contiguous() or view.device != local.device:
        return False
    start = view.storage_offset() * view.element_size()
    own = view.untyped_storage()[start:start + view.numel() * view.element_size()]
    with torch.no_grad():
        local.set_(own, 0, local.size(), local.stride())
    return True


def _mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file mappings ([] where /proc is absent)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[5]))
    return out


def backing_file(t: "torch.Tensor", mappings: list[tuple[int, int, str]] | None = None) -> str | None:
    """The file whose mapping holds `t`'s storage (a DTensor: its local tensor's), or None."""
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    if local.device.type != "cpu" or local.untyped_storage().nbytes() == 0:
        return None
    pointer = local.untyped_storage().data_ptr()
    for start, end, path in _mappings() if mappings is None else mappings:
        if start <= pointer < end:
            return path
    return None


def release(model: "nn.Module", directory: str | os.PathLike) -> list[str]:
    """Copy every tensor of `model` that views a file under `directory` into memory
    of its own (before that file is overwritten); returns their names."""
    import torch
    from torch.distributed.tensor import DTensor

    root = os.path.realpath(directory)
    found = _mappings()
    under = {p for p in {p for _, _, p in found} if os.path.realpath(p).startswith(root + os.sep)}  # each file once: a save's cost
    mappings = [(s, e, p) for s, e, p in found if p in under]
    if not mappings:
        return []
    done, seen = [], set()
    with torch.no_grad():
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            local = t._local_tensor if isinstance(t, DTensor) else t
            if id(local) in seen or backing_file(local, mappings) is None:
                continue
            seen.add(id(local))
            copy = local.clone(memory_format=torch.contiguous_format)
            local.set_(copy.untyped_storage(), 0, local.size(), copy.stride())
            done.append(name)
    return done
