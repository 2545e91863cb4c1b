"""Is a DCP directory a complete checkpoint? Checked before anything is allocated,
so an incomplete one is a TP609 naming what is missing, never a partial load.

Every save writes a manifest, `.tpplan-checkpoint.json`, into its staging
directory after all ranks finished and before the rename: the step, the DCP
save id of its `.metadata`, the size of every file, and the layout it was saved
under (the mesh and the plan: `checkpoint/layout.py`). A directory is complete
when its `.metadata` is there, every shard file the metadata points into is
there and long enough, and (with a manifest) every file the manifest lists has
its size, the save ids agree and a `step-N` directory holds step N. File
contents are not checksummed (a same-sized file rewritten in place by something
else is not caught); the staged rename is what keeps saves whole.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .atomic import write_synced
from ..errors import fail, some

MANIFEST = ".tpplan-checkpoint.json"
STEP_DIR = re.compile(r"step-(\d+)")
INCOMPLETE = "TP609"


def write_manifest(directory: str, *, step: int | None, save_id: str | None, format: str, layout: dict | None = None) -> None:
    """`layout`: what the save records of the mesh and plan it was written under (plain
    JSON data the caller made: `checkpoint/layout.py`), left out when None."""
    files = {e.name: e.stat().st_size for e in os.scandir(directory) if e.is_file() and e.name != MANIFEST}
    manifest = {"version": 1, "format": format, "step": step, "save_id": save_id, "files": dict(sorted(files.items()))}
    if layout is not None:
        manifest["layout"] = layout
    write_synced(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1) + "\n")  # in staging: its entry synced by the commit


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """The manifest, None when the directory has none (a checkpoint of another tool, or older)."""
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise fail(INCOMPLETE, f"the manifest {path} cannot be read: {exc.strerror or exc}", str(path)) from None
    try:
        manifest = json.loads(text)
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files'")
    except (ValueError, AttributeError) as exc:
        raise fail(INCOMPLETE, f"the manifest {path} is not valid ({exc}): the save that wrote it did not finish", str(path)) from None
    return manifest


def manifest_problem(directory: str | Path) -> str | None:
    """What is missing from a directory with a manifest (no torch: its files and
    sizes, and the step of a `step-N` directory); None when nothing is."""
    d = Path(directory)
    manifest = read_manifest(d)
    if manifest is None:
        return f"{d} has no {MANIFEST}"
    missing, short = [], []
    for name, size in manifest["files"].items():
        try:
            actual = (d / name).stat().st_size
        except FileNotFoundError:
            missing.append(name)
            continue
        if actual != size:
            short.append(f"{name} ({actual} bytes, saved {size})")
    if missing:
        return f"files listed in its manifest are missing: {some(missing)}"
    if short:
        return f"files differ in size from its manifest: {some(short)}"
    named = STEP_DIR.fullmatch(d.name)
    if named and manifest.get("step") is not None and int(named.group(1)) != manifest["step"]:
        return f"it holds step {manifest['step']} (mixed steps: its manifest is another save's)"
    return None


def shard_files(metadata) -> dict[str, int]:
    """{file name: the bytes it must hold at least} of the shard files a DCP `.metadata` names."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), info.offset + info.length)
    return needed


def verify(directory: str, metadata, where: str) -> None:
    """TP609 unless the DCP checkpoint in `directory` is complete (see the module doc)."""
    d = Path(directory)
    manifest = read_manifest(d)
    if manifest is not None:
        problem = manifest_problem(d)
        if problem is not None:
            raise fail(INCOMPLETE, f"incomplete checkpoint {d}: {problem}", where)
        saved = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        if manifest.get("save_id") and saved and manifest["save_id"] != saved:
            raise fail(INCOMPLETE, f"incomplete checkpoint {d}: its .metadata is of another save than its files (mixed saves)", where)
    missing, short = [], []
    for name, end in sorted(shard_files(metadata).items()):
        try:
            size = (d / name).stat().st_size
        except FileNotFoundError:
            missing.append(name)
            continue
        if size < end:
            short.append(f"{name} ({size} of {end} bytes)")
    if missing:
        raise fail(INCOMPLETE, f"incomplete checkpoint {d}: shard files its .metadata names are missing: {some(missing)}", where)
    if short:
        raise fail(INCOMPLETE, f"incomplete checkpoint {d}: shard files are shorter than its .metadata says: {some(short)}", where)


def unfinished(directory: Path, entries: list[str]) -> str | None:
    """Why a directory without `.metadata` looks like a DCP save that did not finish (None if it does not)."""
    shards = [e for e in entries if e.endswith(".distcp")]
    if shards:
        return f"{some(shards)} but no .metadata (the save did not finish)"
    if MANIFEST in entries:
        return "a manifest but no .metadata"
    return None
