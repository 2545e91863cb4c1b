"""The safetensors reader (tpplan/checkpoint/reader.py): every slice DCP's planner
may ask for lands in its target byte for byte as safetensors' own slicing gives
it, through each path (direct preadv, coalesced, per-row, buffered, converting,
strided target), and a truncated file is an error naming it."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from tpplan.checkpoint import reader

TENSORS = {
    "a": lambda g: torch.randn(6, 10, generator=g),
    "b": lambda g: torch.randn(300, 700, generator=g).to(torch.bfloat16),
    "c": lambda g: torch.randn(4, 5, 6, generator=g).to(torch.bfloat16),
    "d": lambda g: torch.randn((), generator=g),
    "e": lambda g: torch.arange(7, dtype=torch.int64),
    "f": lambda g: torch.randn(64, 8, generator=g).to(torch.bfloat16),
}

# (key, storage offsets, lengths)
SLICES = [
    ("a", (0, 0), (6, 10)),
    ("a", (1, 0), (3, 10)),
    ("a", (0, 3), (6, 5)),
    ("b", (0, 0), (300, 700)),
    ("b", (150, 0), (150, 700)),
    ("b", (0, 350), (300, 350)),
    ("b", (17, 100), (200, 333)),
    ("c", (1, 0, 2), (2, 5, 3)),
    ("c", (0, 1, 0), (4, 3, 6)),
    ("c", (2, 0, 0), (2, 5, 6)),
    ("d", (), ()),
    ("e", (2,), (4,)),
    ("f", (0, 0), (32, 8)),
    ("f", (32, 0), (32, 8)),
]


class Planner:
    """DCP's DefaultLoadPlanner's part the reader uses: a view of the target per item."""

    def __init__(self, targets):
        self.targets = targets
        self.committed = []

    def resolve_tensor(self, item):
        target = self.targets[item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, item, tensor):
        self.committed.append(item.dest_index.fqn)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reader")
    g = torch.Generator().manual_seed(0)
    save_file({k: make(g) for k, make in TENSORS.items()}, directory / "model.safetensors")
    storage = HuggingFaceStorageReader(str(directory))
    storage.set_up_storage_reader(storage.read_metadata(), is_coordinator=True)
    return directory / "model.safetensors", storage.storage_data


def expected(file, key, offsets, lengths):
    with safe_open(str(file), framework="pt") as f:
        if not lengths:
            return f.get_tensor(key)
        return f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def load(storage_data, file, cases, dtype=None, strided=False):
    """Read `cases` in one call (one file, as DCP groups them) into fresh targets."""
    targets, items = {}, []
    for n, (key, offsets, lengths) in enumerate(cases):
        name = f"{n}:{key}"
        want = dtype or expected(file, key, offsets, lengths).dtype
        if strided and len(lengths) == 2:  # the target is a column block of a wider tensor
            targets[name] = torch.full((lengths[0], lengths[1] + 3), -7, dtype=want)
            dest = (0, 2)
        else:
            targets[name] = torch.full(tuple(lengths), -7, dtype=want)
            dest = (0,) * len(lengths)
        items.append(ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(name),
            dest_offsets=torch.Size(dest),
            storage_index=MetadataIndex(key, (0,) * len(lengths)),
            storage_offsets=torch.Size(offsets),
            lengths=torch.Size(lengths),
        ))
    planner = Planner(targets)
    reader.read_file(str(file), items, storage_data, planner)
    assert sorted(planner.committed) == sorted(targets)
    out = {}
    for n, (key, offsets, lengths) in enumerate(cases):
        target = targets[f"{n}:{key}"]
        if strided and len(lengths) == 2:
            assert bool((target[:, :2] == -7).all()) and bool((target[:, 2 + lengths[1]:] == -7).all())
            target = target[:, 2:2 + lengths[1]]
        out[n] = target
    return out


@pytest.mark.parametrize("min_run", [reader.MIN_RUN, 0], ids=["default", "per-row-direct"])
@pytest.mark.parametrize("block", [reader.BLOCK_BYTES, 1000], ids=["block", "tiny-block"])
def test_every_slice_equals_safetensors_own_slicing(checkpoint, monkeypatch, min_run, block):
    file, storage_data = checkpoint
    monkeypatch.setattr(reader, "MIN_RUN", min_run)
    monkeypatch.setattr(reader, "BLOCK_BYTES", block)
    got = load(storage_data, file, SLICES)
    for n, (key, offsets, lengths) in enumerate(SLICES):
        want = expected(file, key, offsets, lengths)
        assert got[n].dtype == want.dtype and torch.equal(got[n], want), (key, offsets, lengths)


def test_converting_and_strided_targets_get_the_same_values(checkpoint):
    file, storage_data = checkpoint
    floating = [c for c in SLICES if TENSORS[c[0]](torch.Generator()).is_floating_point()]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = load(storage_data, file, floating, dtype=dtype)
        strided = load(storage_data, file, floating, dtype=dtype, strided=True)
        for n, (key, offsets, lengths) in enumerate(floating):
            want = expected(file, key, offsets, lengths).to(dtype)
            assert torch.equal(got[n], want) and torch.equal(strided[n], want), (dtype, key, offsets)


def test_adjacent_slices_are_read_in_one_call(checkpoint, monkeypatch):
    file, storage_data = checkpoint
    calls = []
    real = reader.os.preadv
    monkeypatch.setattr(reader.os, "preadv", lambda fd, buffers, offset: calls.append(len(buffers)) or real(fd, buffers, offset))
    load(storage_data, file, [("f", (0, 0), (32, 8)), ("f", (32, 0), (32, 8))])
    assert calls == [2]  # the two halves of f are adjacent in the file: one preadv into both targets


def test_a_truncated_file_is_an_error_naming_it(checkpoint, tmp_path):
    file, storage_data = checkpoint
    short = tmp_path / "short.safetensors"
    data = file.read_bytes()
    short.write_bytes(data[: len(data) - 100])
    moved = {index: type(info)(str(short), info.shape, info.dtype) for index, info in storage_data.items()}
    with open(file, "rb") as f:
        _, header = reader._header(f.fileno(), str(file))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    info = next(v for k, v in storage_data.items() if k.fqn == last)
    whole = (last, (0,) * len(info.shape), tuple(info.shape))
    with pytest.raises(ValueError, match="short.safetensors: ends at byte"):
        load(moved, short, [whole], dtype=info.dtype)
