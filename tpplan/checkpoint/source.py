"""Where a checkpoint is and what it holds: its format, the
`torch.distributed.checkpoint` storage reader for it, and its metadata.

Reading the metadata reads only safetensors headers (`HuggingFaceStorageReader`)
or the DCP `.metadata` file (`FileSystemReader`); no tensor data. The
HuggingFace reader leaves some tensors as views of the file's mapping
(`mapped.py`: read on first use; a file truncated meanwhile -> SIGBUS).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import fail, first_line, some
from .training.complete import manifest_problem, read_manifest, shard_files, unfinished, verify
from .training.state import RESERVED
from .training.steps import is_root, latest

INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"


@dataclass
class Source:
    """A checkpoint: `format` "hf" (safetensors) or "dcp"; `directory` is what the
    reader reads; `files` the data files (a DCP checkpoint's: the shard files its
    `.metadata` names, known after `read_metadata`); `where` the file problems point at."""

    path: str
    format: str
    directory: str
    files: list[str]
    where: str
    tensors: dict[str, Any] = field(default_factory=dict)  # key -> TensorStorageMetadata
    file_of: dict[str, str] = field(default_factory=dict)  # key -> the file holding it (hf)
    keys: set[str] = field(default_factory=set)  # every key of the metadata (the model's, the optimizer's, extra)
    step: int | None = None  # the training step it holds (a step-N checkpoint)
    layout: dict | None = None  # the mesh and plan it was saved under (its manifest's; layout.py), None if unrecorded
    held: dict[str, Any] = field(default_factory=dict)  # key -> TensorStorageMetadata of the optimizer's state (training/state.py)
    _tmp: Any = None  # a TemporaryDirectory that must live as long as the reader

    def reader(self):
        from torch.distributed.checkpoint import FileSystemReader

        return _hf_reader_class()(self.directory) if self.format == "hf" else FileSystemReader(self.directory)

    def file_for(self, key: str) -> str:
        return self.file_of.get(key, self.where)


_READER = None
CHUNK_BYTES = 16 << 20
READ_THREADS = min(4, os.cpu_count() or 1)  # copying threads per rank: transformers' loader uses as many


def _hf_reader_class():
    """torch's HuggingFaceStorageReader, with two changes to its I/O (metadata,
    planning -- which slices this rank needs -- and the target tensors stay torch's):

    - a request that is one contiguous byte range of the file (a replicated
      tensor, a shard on dim 0) into a whole local tensor that `load_checkpoint`
      just allocated, in the checkpoint's dtype, is not copied: that tensor
      becomes a view of safetensors' private mapping of the file, read when it
      is first used, as transformers' `from_pretrained` does (`mapped.py`);
    - every other request is copied in row blocks of at most CHUNK_BYTES, with
      the file opened for that block alone. safetensors maps a file, and every
      page a read touches counts in the process's RSS until the mapping goes;
      torch's reader keeps each file open for all its reads and copies each
      whole slice before writing it into its target, so a rank's RSS would grow
      beyond its own shards by the pages it touched (a rowwise shard touches
      every page of its tensor) plus its largest slice. Blocks bound both by
      ~2 x CHUNK_BYTES per thread; READ_THREADS threads copy (a tensor copy
      releases the GIL), as transformers' loader does."""
    global _READER
    if _READER is None:
        import math
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
        from torch.futures import Future

        from . import mapped

        class BlockedHuggingFaceStorageReader(HuggingFaceStorageReader):
            def read_data(self, plan, planner):
                views: dict = {}  # file -> the safetensors handle whose views become tensors
                copies = []
                try:
                    for request in plan.items:
                        info = self.storage_data[request.storage_index]
                        if not self._map_request(info, request, planner, views):
                            copies.append((info.relative_path, request))
                finally:
                    for handle in views.values():  # the views keep their mapping alive
                        handle.__exit__(None, None, None)
                copies.sort(key=lambda c: -math.prod(c[1].lengths))  # the biggest first: the threads end together
                workers = min(READ_THREADS, len(copies))
                if workers <= 1:
                    for file_name, request in copies:
                        self._read_request(file_name, request, planner)
                else:  # copies release the GIL
                    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tpplan-read")
                    try:
                        for future in [pool.submit(self._read_request, f, r, planner) for f, r in copies]:
                            future.result()
                    finally:
                        pool.shutdown(wait=True, cancel_futures=True)
                done: Future = Future()
                done.set_result(None)
                return done

            def _map_request(self, info, request, planner, views) -> bool:
                from safetensors import safe_open

                target = mapped.whole_target(planner, request, info.dtype)
                if target is None or not mapped.contiguous_rows(request, info.shape):
                    return False
                if info.relative_path not in views:
                    views[info.relative_path] = safe_open(filename=info.relative_path, framework="pt")
                handle, fqn = views[info.relative_path], request.storage_index.fqn
                if request.lengths:
                    start = request.storage_offsets[0]
                    view = handle.get_slice(fqn)[start:start + request.lengths[0]]  # no page is read
                else:
                    view = handle.get_tensor(fqn)
                if not mapped.adopt(target, view):
                    return False
                planner.commit_tensor(request, target)
                return True

            def _read_request(self, file_name, request, planner):
                from safetensors import safe_open

                target = planner.resolve_tensor(request).detach()
                offsets, lengths = list(request.storage_offsets), list(request.lengths)
                if not lengths:  # a 0-d tensor
                    with safe_open(filename=file_name, framework="pt") as f:
                        target.copy_(f.get_tensor(request.storage_index.fqn))
                else:
                    row = math.prod(lengths[1:]) * target.element_size()
                    step = max(1, CHUNK_BYTES // max(row, 1))
                    rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
                    for start in range(0, lengths[0], step):
                        n = min(step, lengths[0] - start)
                        with safe_open(filename=file_name, framework="pt") as f:
                            block = f.get_slice(request.storage_index.fqn)[(slice(offsets[0] + start, offsets[0] + start + n), *rest)]
                            target[start:start + n].copy_(block)
                            del block
                planner.commit_tensor(request, target)

        _READER = BlockedHuggingFaceStorageReader
    return _READER


def locate(path: str | os.PathLike) -> Source:
    """The checkpoint at `path` (file or directory), or CheckpointError TP600."""
    text = os.fspath(path)
    p = Path(text)
    try:
        is_dir = p.is_dir()
        if not is_dir and not p.exists():
            raise fail("TP600", f"checkpoint {text!r} does not exist", text)
        entries = sorted(os.listdir(p)) if is_dir else []
        if not is_dir:
            with open(p, "rb"):
                pass
    except PermissionError:
        raise fail("TP600", f"checkpoint {text!r} is not readable (permission denied)", text) from None
    except OSError as exc:
        raise fail("TP600", f"checkpoint {text!r} cannot be read: {exc.strerror or exc}", text) from None
    if not is_dir:
        if p.name == DCP_METADATA:
            return _dcp(p.parent, text)
        if p.name.endswith(".index.json"):
            return _hf_index(p.parent, p, text)
        if p.suffix == ".safetensors":
            return _hf_files(p.parent, [p], str(p), text, own_dir=False)
        raise fail("TP600", f"{text!r} is not a checkpoint: give a .safetensors file, a directory of them, or a DCP directory", text)
    if DCP_METADATA in entries:
        return _dcp(p, text)
    if INDEX in entries or any(name.endswith(".safetensors") for name in entries):
        problem = manifest_problem(p) if read_manifest(p) is not None else None
        if problem is not None:
            raise fail("TP609", f"incomplete checkpoint {p}: {problem}", text)
    if INDEX in entries:
        return _hf_index(p, p / INDEX, text)
    found = [p / name for name in entries if name.endswith(".safetensors")]
    if found:
        return _hf_files(p, found, str(found[0]) if len(found) == 1 else str(p), text, own_dir=True)
    why = unfinished(p, entries)
    if why is not None:
        raise fail("TP609", f"incomplete checkpoint {p}: {why}", text)
    if is_root(p, entries):  # a training root: its latest complete step
        directory, step = latest(p)
        source = locate(directory)
        source.step = step
        return source
    shown = some(entries) if entries else "it is empty"
    raise fail(
        "TP600",
        f"directory {text!r} is not a checkpoint: no *.safetensors, no {INDEX} and no DCP {DCP_METADATA} ({shown})",
        text,
    )


def _dcp(directory: Path, text: str) -> Source:
    manifest = read_manifest(directory)
    step = manifest.get("step") if manifest else None
    layout = manifest.get("layout") if manifest else None
    return Source(text, "dcp", str(directory), [], str(directory / DCP_METADATA), step=step, layout=layout)


def _hf_index(directory: Path, index: Path, text: str) -> Source:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise fail("TP605", f"the index {index} cannot be read as a safetensors index ({type(exc).__name__}: {exc})", str(index)) from None
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise fail("TP605", f"the index {index} names files that are missing: {some(missing)}", str(index))
    files = [directory / name for name in names]
    own = {str(f) for f in directory.glob("*.safetensors")} == {str(f) for f in files}
    return _hf_files(directory, files, str(index), text, own_dir=own)


def _hf_files(directory: Path, files: list[Path], where: str, text: str, own_dir: bool) -> Source:
    """HuggingFaceStorageReader reads every *.safetensors of its directory: when the
    checkpoint is a subset of one (one file named, an index naming some), it reads a
    private directory of links to exactly those files."""
    tmp = None
    if not own_dir:
        tmp = tempfile.TemporaryDirectory(prefix="tpplan-ckpt-")
        for f in files:
            os.symlink(f.resolve(), os.path.join(tmp.name, f.name))
        directory = Path(tmp.name)
    return Source(text, "hf", str(directory), [str(f) for f in files], where, _tmp=tmp)


def read_metadata(source: Source):
    """The checkpoint's DCP `Metadata` (headers only); fills `source.tensors` and
    `source.file_of`. A file that cannot be decoded is TP605, naming it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = source.reader()
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # safetensors or unpickling errors: named by file below
        raise _corrupt(source, exc) from None
    if source.format == "dcp":
        verify(source.directory, metadata, source.where)  # TP609: missing or short shards, mixed saves
        source.files = [os.path.join(source.directory, name) for name in sorted(shard_files(metadata))]
    source.keys = set(metadata.state_dict_metadata)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    source.tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{RESERVED}.")}  # the model's
    source.held = {k: v for k, v in tensors.items() if k.startswith(f"{RESERVED}.")}  # the optimizer's: training/state.py
    if source.format == "hf":
        link_to = {os.path.join(source.directory, os.path.basename(f)): f for f in source.files}
        for index, info in metadata.storage_data.items():
            source.file_of[index.fqn] = link_to.get(info.relative_path, info.relative_path)
    return metadata


def _corrupt(source: Source, exc: BaseException):
    if source.format == "dcp":
        return fail("TP605", f"the DCP metadata {source.where} cannot be read: {type(exc).__name__}: {first_line(exc)}", source.where)
    from safetensors import safe_open

    for f in source.files:
        try:
            with safe_open(f, framework="pt") as handle:
                handle.keys()
        except Exception as inner:  # safetensors' SafetensorError and OS errors: this file is the bad one
            return fail("TP605", f"{f} is not a valid safetensors file (corrupt or truncated): {first_line(inner)}", f)
    return fail("TP605", f"the safetensors headers of {source.path} cannot be read: {type(exc).__name__}: {first_line(exc)}", source.where)

