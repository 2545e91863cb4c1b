"""The checkpoint steps of `tpplan apply`, called from the runtime (torchrun and
dry run): plain functions of a model and a path that return report data, so the
runtime needs a line or two for each.

- `preflight`: before the ranks compare plans: the path is readable and its
  metadata fits the (unsharded, meta) model: the same answer on every rank.
- `load_into`: load into the sharded model; the report's `checkpoint` entry.
- `inspect_into`: the dry run's check, from headers / metadata alone, with the
  bytes each simulated rank would read.
- `will_load`: the same check against a layout the dry run does not simulate: the
  unsharded model's global tensors and the optimizer state (DCP reshards the rest).
- `save_from`: write the model after the run, recording the plan and the mesh.

Each entry says the layout the checkpoint was saved under and the target's
(`layout.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .errors import CheckpointError
from .inspect import match
from .layout import layout_entry, optimizer_problems
from .source import Source, locate, read_metadata

if TYPE_CHECKING:
    from torch import nn


def open_checkpoint(path: str) -> Source:
    """The located checkpoint with its metadata read (headers only); CheckpointError if not."""
    source = locate(path)
    read_metadata(source)
    return source


def preflight(model: "nn.Module", path: str, allow_missing: Iterable[str]) -> None:
    """Raise CheckpointError when `path` cannot be loaded into `model` (keys, shapes, dtypes)."""
    found = match(model, open_checkpoint(path), allow_missing)
    if found.problems:
        raise CheckpointError(found.problems)


def load_into(model: "nn.Module", path: str, allow_missing: Iterable[str], device, target: dict[str, int]) -> dict:
    """Load into the sharded model; the report's entry (`target`: the job's mesh)."""
    from .load import load_checkpoint

    result = load_checkpoint(model, path, allow_missing=tuple(allow_missing), device=device)
    assert result.match is not None
    ranks = max((len(e.local_shapes) for e in result.match.loads.values()), default=1)
    return {**result.match.summary(ranks), "recomputed_buffers": result.recomputed_buffers,
            "layout": layout_entry(result.match.source, target)}


def inspect_into(model: "nn.Module", source: Source, allow_missing: Iterable[str], ranks: int,
                 target: dict[str, int]) -> tuple[dict, list]:
    """(the report's `checkpoint` entry, problems) for a sharded fake model on the mesh `target`."""
    found = match(model, source, allow_missing)
    return {**found.summary(ranks), "layout": layout_entry(source, target)}, problems_of(model, source, found)


def will_load(model: "nn.Module", source: Source, allow_missing: Iterable[str], target: dict[str, int]) -> tuple[dict, list]:
    """(the report's `checkpoint` entry, problems) of loading `source` under the mesh
    `target`, from headers alone, for the unsharded (meta) model: DCP reshards any layout
    of the same global tensors, so what decides is the model's keys, shapes and dtypes and
    the optimizer state's shapes. What each rank reads is not simulated (`rank_read_bytes`
    is empty)."""
    found = match(model, source, allow_missing)
    entry = {**found.summary(1), "rank_read_bytes": [], "layout": layout_entry(source, target)}
    return entry, problems_of(model, source, found)


def problems_of(model: "nn.Module", source: Source, found) -> list:
    """The model's problems with the checkpoint, else its optimizer state's (the same
    model's state: a wrong shape would say the same twice)."""
    return list(found.problems) or optimizer_problems(model, source)


def save_from(model: "nn.Module | list[nn.Module]", path: str, format: str, plan=None) -> dict:
    from .save import save_checkpoint

    save_checkpoint(model, path, format=format, plan=plan)
    return {"path": path, "format": format}
