"""How a rank's safetensors bytes are read: torch's `HuggingFaceStorageReader`
with its `read_data` reading each slice with `os.preadv` straight into the
tensor it fills.

`torch.distributed.checkpoint` stays in charge: its metadata (safetensors
headers, read by torch's reader), its planner (which slices of which tensors
this rank needs: `ReadItem`s), and its target tensors (`planner.resolve_tensor`,
a view of the local shard). Only the I/O differs from torch's reader, which maps
each file (`safe_open`), copies each whole slice out of the mapping and then
copies that into its target: every page it touches is a page fault and counts
in the rank's RSS until the file is closed, and the slice is held twice.

Here each file is opened once per rank (a plain descriptor, no mapping). A
slice of a row-major tensor is a set of contiguous byte runs in the file (one
run when only its first dimension is cut, one per row when a later one is).
A target of the file's dtype on the CPU, contiguous, whose runs are long
(>= MIN_RUN) receives the bytes directly: no copy in user space, no buffer, and
runs adjacent in the file (across tensors too) are read by one `preadv`
scattering into their targets. Any other target (another dtype, another
device, a strided view) or short runs (a slice cut along dim 1 of a weight:
one run per row, thousands of tiny reads) go through a buffer of at most
BLOCK_BYTES of whole rows, read in one call, then `copy_` picks the slice's
columns and converts the dtype (the conversion torch would do anyway).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys

BLOCK_BYTES = 4 << 20  # the buffer of a converting, short-run, strided or device read
IOV_MAX = 512  # buffers per preadv call (Linux allows 1024)
MIN_RUN = 256 << 10  # shorter runs (a slice cut along a later dim, one per row) go through the buffer
MAX_CALL = 1 << 30  # bytes per preadv call (Linux returns at most ~2 GiB per call)

_READER = None


def hf_reader_class():
    """torch's HuggingFaceStorageReader with `read_data` reading by `os.preadv`
    (see the module's docstring). Built on first use: importing this module
    imports no torch."""
    global _READER
    if _READER is None:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
        from torch.futures import Future

        class PreadHuggingFaceStorageReader(HuggingFaceStorageReader):
            def read_data(self, plan, planner):
                if not hasattr(os, "preadv"):  # not on Windows: torch's own reader
                    return super().read_data(plan, planner)
                per_file: dict[str, list] = {}
                for item in plan.items:
                    per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
                for file_name, items in per_file.items():
                    read_file(file_name, items, self.storage_data, planner)
                done: Future = Future()
                done.set_result(None)
                return done

        _READER = PreadHuggingFaceStorageReader
    return _READER


def read_file(file_name: str, items: list, storage_data: dict, planner) -> None:
    """Fill the targets of `items` (ReadItems of one safetensors file): direct
    reads first, coalesced across tensors, then the buffered ones."""
    fd = os.open(file_name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        data_start, header = _header(fd, file_name)
        direct: list[tuple] = []
        buffered = []
        committed = []
        for item in items:
            info = storage_data[item.storage_index]
            begin = _tensor_begin(header, item.storage_index.fqn, info, data_start, file_name)
            target = planner.resolve_tensor(item).detach()
            lengths = list(item.lengths)
            if list(target.shape) != lengths:
                raise AssertionError(f"req {item.storage_index} mismatch sizes {list(target.shape)} vs {lengths}")
            if target.numel() == 0:
                committed.append((item, target))
                continue
            shape, offsets = list(info.shape), list(item.storage_offsets)
            if _direct(target, info.dtype) and _long_runs(shape, offsets, lengths, target.element_size()):
                direct += _runs(begin, shape, offsets, lengths, target.element_size(), _bytes_of(target))
                committed.append((item, target))
            else:
                buffered.append((item, info, begin, target))
        _read_runs(fd, direct, file_name)
        for item, target in committed:
            planner.commit_tensor(item, target)
        scratch = _Scratch()
        for item, info, begin, target in buffered:
            _read_buffered(fd, item, info, begin, target, file_name, scratch)
            planner.commit_tensor(item, target)
    finally:
        os.close(fd)


def _header(fd: int, file_name: str) -> tuple[int, dict]:
    """(where the data starts, the header's tensor entries) of a safetensors file."""
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise ValueError(f"{file_name}: too short for a safetensors header")
    (size,) = struct.unpack("<Q", head)
    text = os.pread(fd, size, 8)
    if len(text) != size:
        raise ValueError(f"{file_name}: the safetensors header is truncated")
    return 8 + size, json.loads(text)


def _tensor_begin(header: dict, key: str, info, data_start: int, file_name: str) -> int:
    """The file offset of tensor `key`'s first byte, its size checked against the metadata."""
    entry = header.get(key)
    if entry is None:
        raise ValueError(f"{file_name}: no tensor {key!r} in its header")
    begin, end = entry["data_offsets"]
    itemsize = _itemsize(info.dtype)
    if end - begin != math.prod(info.shape) * itemsize:
        raise ValueError(f"{file_name}: tensor {key!r} holds {end - begin} bytes, not {math.prod(info.shape) * itemsize}")
    return data_start + begin


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _direct(target, file_dtype) -> bool:
    return (
        target.dtype == file_dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
        and sys.byteorder == "little"  # safetensors stores little-endian
    )


def _bytes_of(tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (through ctypes:
    `Tensor.numpy()` would import numpy, ~8 MiB of RSS, for nothing)."""
    import ctypes

    size = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")


def _cut(shape: list[int], offsets: list[int], lengths: list[int]) -> int:
    """The last dimension the slice cuts (0 when it cuts none): the dimensions
    after it are whole, so a run of the file is lengths[cut] x their sizes."""
    return max((d for d in range(len(shape)) if (offsets[d], lengths[d]) != (0, shape[d])), default=0)


def _long_runs(shape: list[int], offsets: list[int], lengths: list[int], itemsize: int) -> bool:
    """Whether the slice is one run of the file, or runs of at least MIN_RUN bytes."""
    if not shape:
        return True
    cut = _cut(shape, offsets, lengths)
    return cut == 0 or lengths[cut] * math.prod(shape[cut + 1:]) * itemsize >= MIN_RUN


def _runs(begin: int, shape: list[int], offsets: list[int], lengths: list[int], itemsize: int, buffer: memoryview) -> list[tuple]:
    """The contiguous byte runs (file offset, bytes, part of `buffer`) of the slice
    `offsets`/`lengths` of a row-major tensor of `shape` at file offset `begin`, in
    the order of `buffer` (the slice, contiguous)."""
    if not shape:  # a 0-d tensor
        return [(begin, itemsize, buffer)]
    cut = _cut(shape, offsets, lengths)
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(len(shape))]
    run = lengths[cut] * strides[cut]
    first = begin + sum(o * s for o, s in zip(offsets[: cut + 1], strides))
    if cut == 0:
        return [(first, run, buffer)]
    if cut == 1:  # one run per row: the usual slice cut along dim 1
        step = strides[0]
        return [(first + r * step, run, buffer[r * run:(r + 1) * run]) for r in range(lengths[0])]
    import itertools

    starts = itertools.product(*(range(n) for n in lengths[:cut]))
    return [
        (first + sum(i * s for i, s in zip(index, strides)), run, buffer[k * run:(k + 1) * run])
        for k, index in enumerate(starts)
    ]


def _read_runs(fd: int, runs: list[tuple], file_name: str) -> None:
    """Read every run (file offset, bytes, buffer); runs adjacent in the file go in one preadv."""
    runs.sort(key=lambda r: r[0])
    i = 0
    while i < len(runs):
        start, length, buffer = runs[i]
        buffers = [buffer]
        end = start + length
        j = i + 1
        while j < len(runs) and runs[j][0] == end and len(buffers) < IOV_MAX and end - start < MAX_CALL:
            buffers.append(runs[j][2])
            end += runs[j][1]
            j += 1
        _preadv_all(fd, buffers, start, end - start, file_name)
        i = j


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, total: int, file_name: str) -> None:
    """preadv until `total` bytes are in `buffers` (a call may return fewer)."""
    done = 0
    while done < total:
        if done:  # skip what the short read filled
            skip = done
            rest = []
            for b in buffers:
                if skip >= len(b):
                    skip -= len(b)
                    continue
                rest.append(b[skip:])
                skip = 0
            buffers = rest
        got = os.preadv(fd, buffers[:IOV_MAX], offset + done)
        if got == 0:
            raise ValueError(f"{file_name}: ends at byte {offset + done}, before the {total} bytes at {offset} (truncated file?)")
        done += got


class _Scratch:
    """One buffer for a file's buffered reads, grown when needed (at most
    BLOCK_BYTES unless a single row is larger): one allocation, not one per
    tensor, so the allocator keeps no freed blocks around."""

    def __init__(self):
        self.data = None

    def get(self, shape: tuple, dtype):
        import torch

        size = max(math.prod(shape) * _itemsize(dtype), 1)
        if self.data is None or self.data.numel() < size:
            self.data = torch.empty(size, dtype=torch.uint8)
        return self.data[:size].view(dtype).view(shape) if shape else self.data[:size].view(dtype)[0]


def _read_buffered(fd: int, item, info, begin: int, target, file_name: str, scratch: _Scratch) -> None:
    """Blocks of whole rows (dim 0) of the file's tensor into a buffer of its dtype
    (at most BLOCK_BYTES, one read each), then `copy_` of the slice's part into
    `target` (picking the columns of a slice cut along a later dim, converting the
    dtype, to its device, into its strides)."""
    lengths = list(item.lengths)
    offsets = list(item.storage_offsets)
    shape = list(info.shape)
    itemsize = _itemsize(info.dtype)
    if not lengths:  # a 0-d tensor
        buffer = scratch.get((), info.dtype)
        _read_runs(fd, [(begin, itemsize, _bytes_of(buffer))], file_name)
        target.copy_(buffer)
        return
    row = max(math.prod(shape[1:]) * itemsize, 1)
    step = max(1, BLOCK_BYTES // row)
    rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
    for start in range(0, lengths[0], step):
        n = min(step, lengths[0] - start)
        block = scratch.get((n, *shape[1:]), info.dtype)
        _read_runs(fd, [(begin + (offsets[0] + start) * row, n * row, _bytes_of(block))], file_name)
        target[start:start + n].copy_(block[(slice(None), *rest)])
