"""The checkpoint steps of `tpplan apply`, called from the runtime (torchrun and
dry run): plain functions of a model and a path that return report data, so the
runtime needs a line or two for each.

- `preflight`: before the ranks compare plans: the path is readable and its
  metadata fits the (unsharded, meta) model: the same answer on every rank.
- `load_into`: load into the sharded model; the report's `checkpoint` entry.
- `inspect_into`: the dry run's check, from headers / metadata alone, with the
  bytes each simulated rank would read.
- `save_from`: write the model after the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .errors import CheckpointError
from .inspect import match
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


def load_into(model: "nn.Module", path: str, allow_missing: Iterable[str], device) -> dict:
    from .load import load_checkpoint

    result = load_checkpoint(model, path, allow_missing=tuple(allow_missing), device=device)
    assert result.match is not None
    ranks = max((len(e.local_shapes) for e in result.match.loads.values()), default=1)
    return {**result.match.summary(ranks), "recomputed_buffers": result.recomputed_buffers}


def inspect_into(model: "nn.Module", source: Source, allow_missing: Iterable[str], ranks: int) -> tuple[dict, list]:
    """(the report's `checkpoint` entry, problems) for a sharded fake model."""
    found = match(model, source, allow_missing)
    return found.summary(ranks), found.problems


def save_from(model: "nn.Module", path: str, format: str) -> dict:
    from .save import save_checkpoint

    save_checkpoint(model, path, format=format)
    return {"path": path, "format": format}
