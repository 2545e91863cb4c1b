"""A checkpoint's metadata against a (possibly sharded, meta or fake) model:
which keys it loads, which are missing or unexpected, which have another shape
or an incompatible dtype, and the bytes each TP rank reads.

Used before any tensor is read by `load_checkpoint` (so a bad checkpoint leaves
the model untouched) and by `apply --dry-run --checkpoint` (so it fails before a
job starts).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.local_shapes import local_shapes
from ..core.problems import Problem, error
from .errors import some
from .experts import Conversions, conversions, fused_parts, part_shape
from .source import Source
from .stages import others_prefixes

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class Expected:
    """One tensor of the model's state dict: every name it goes by (tied
    parameters have several), its full shape and dtype, what each rank holds."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: "torch.dtype"
    local_shapes: list[tuple[int, ...]]  # one per rank of its mesh (one entry when not a DTensor)
    is_parameter: bool


@dataclass
class Match:
    source: Source
    loads: dict[str, Expected] = field(default_factory=dict)  # checkpoint key -> tensor it fills
    allowed_missing: list[Expected] = field(default_factory=list)
    missing: list[Expected] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    # fused expert parameter -> (the tensor it is, the per-expert checkpoint keys filling it)
    fused: dict[str, tuple[Expected, list]] = field(default_factory=dict)

    def rank_bytes(self, ranks: int) -> list[int]:
        """Bytes of checkpoint data each rank reads (its shards, in the checkpoint's dtype)."""
        out = []
        for rank in range(ranks):
            total = 0
            for key, exp in self.loads.items():
                shape = exp.local_shapes[rank] if len(exp.local_shapes) > rank else exp.local_shapes[0]
                total += math.prod(shape) * _itemsize(self.source.tensors[key].properties.dtype)
            for exp, parts in self.fused.values():  # a rank reads exactly its shard's elements of the parts
                shape = exp.local_shapes[rank] if len(exp.local_shapes) > rank else exp.local_shapes[0]
                total += math.prod(shape) * _itemsize(self.source.tensors[parts[0].key].properties.dtype)
            out.append(total)
        return out

    @property
    def checkpoint_bytes(self) -> int:
        return sum(math.prod(md.size) * _itemsize(md.properties.dtype) for md in self.source.tensors.values())

    def summary(self, ranks: int) -> dict:
        """The `checkpoint` entry of `apply`'s report."""
        return {
            "path": self.source.path,
            "format": self.source.format,
            "files": len(self.source.files),
            "tensors": len(self.source.tensors),
            "loaded": len(self.loads) + sum(len(parts) for _, parts in self.fused.values()),
            "missing": [e.names[0] for e in self.missing],
            "allowed_missing": [e.names[0] for e in self.allowed_missing],
            "unexpected": list(self.unexpected),
            "checkpoint_bytes": self.checkpoint_bytes,
            "rank_read_bytes": self.rank_bytes(ranks),
            "dtypes": sorted({str(self.source.tensors[k].properties.dtype).removeprefix("torch.") for k in self.loads}),
        }


def _itemsize(dtype: "torch.dtype") -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def expected_tensors(model: "nn.Module") -> list[Expected]:
    """The model's parameters and persistent buffers, tied ones once (with all names)."""
    by_id: dict[int, Expected] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        _add(by_id, name, param, True)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for key, buffer in module._buffers.items():
            if buffer is None or key in module._non_persistent_buffers_set:
                continue
            _add(by_id, f"{module_name}.{key}" if module_name else key, buffer, False)
    return list(by_id.values())


def _add(by_id: dict, name: str, t: "torch.Tensor", is_parameter: bool) -> None:
    found = by_id.get(id(t))
    if found is not None:
        if name not in found.names:
            found.names.append(name)
        return
    by_id[id(t)] = Expected([name], tuple(t.shape), t.dtype, list(local_shapes(t)), is_parameter)


def _ignored_unexpected(model: "nn.Module") -> list[re.Pattern]:
    """transformers models list keys of old checkpoints to ignore (rotary inv_freq tables);
    a pipeline stage leaves the other stages' keys to the ranks that hold them."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    return [re.compile(p) for p in patterns] + [re.compile("^" + re.escape(prefix)) for prefix in others_prefixes(model)]


def match(model: "nn.Module", source: Source, allow_missing: Iterable[str] = ()) -> Match:
    """Compare `source.tensors` (read_metadata first) with the model."""
    result = Match(source)
    allow = list(allow_missing)
    keys = set(source.tensors)
    expected = expected_tensors(model)
    claimed: set[str] = set()
    names = {n for exp in expected for n in exp.names}
    # transformers' conversion mapping (slow to build: ~1000 regexes) only matters for
    # keys the model does not name and tensors the checkpoint does not hold by name
    unnamed = bool(keys - names) or any(not any(n in keys for n in exp.names) for exp in expected)
    conv = conversions(model) if unnamed else Conversions()
    # checkpoint keys as the model names them (transformers' renamings), for keys it does not name
    alias = {key: key for key in keys}
    for key in keys - names:
        alias.setdefault(conv.model_key(key), key)
    for exp in expected:
        key = next((alias[n] for n in exp.names if n in alias), None)
        parts = fused_parts(exp.names[0], exp.shape, alias, conv) if key is None else None
        if parts is not None:  # transformers' per-expert keys of a fused expert parameter
            claimed.update(p.key for p in parts)
            result.fused[exp.names[0]] = (exp, parts)
            continue
        if key is None:
            if any(fnmatch.fnmatchcase(n, pattern) for n in exp.names for pattern in allow):
                result.allowed_missing.append(exp)
            else:
                result.missing.append(exp)
            continue
        claimed.update(alias[n] for n in exp.names if n in alias)
        result.loads[key] = exp
    ignored = _ignored_unexpected(model)
    result.unexpected = sorted(k for k in keys - claimed if not any(p.search(k) for p in ignored))
    result.problems = _problems(result, len(expected))
    return result


def _problems(m: Match, n_expected: int) -> list[Problem]:
    src = m.source
    problems = []
    missing = [e.names[0] for e in m.missing]
    if missing and m.unexpected and len(missing) > n_expected / 2:
        problems.append(error(
            "TP606",
            f"{src.path} does not look like a checkpoint of this model: {len(missing)} of its {n_expected} tensors are missing "
            f"({some(missing, 3)}) and {len(m.unexpected)} of the checkpoint's are unexpected ({some(m.unexpected, 3)})",
            src.where,
        ))
        return problems
    if missing:
        problems.append(error(
            "TP601",
            f"{len(missing)} tensors of the model are missing from {src.path}: {some(missing, 8)}"
            " (--allow-missing PATTERN, allow_missing=, names keys that may be missing)",
            src.where,
        ))
    if m.unexpected:
        hints = []
        for key in m.unexpected[:8]:
            close = difflib.get_close_matches(key, missing, n=1, cutoff=0.8)
            hints.append(f"{key} (the model has {close[0]})" if close else key)
        more = f" (and {len(m.unexpected) - 8} more)" if len(m.unexpected) > 8 else ""
        problems.append(error(
            "TP602",
            f"{len(m.unexpected)} tensors of {src.path} are not in the model: {', '.join(hints)}{more}",
            src.file_for(m.unexpected[0]),
        ))
    for exp, parts in m.fused.values():
        for part in parts:
            md, want = src.tensors[part.key], part_shape(exp.shape, part)
            if tuple(md.size) != want:
                problems.append(error(
                    "TP603",
                    f"{part.key} has shape {tuple(md.size)} in {src.file_for(part.key)}; as expert {part.expert} of "
                    f"{exp.names[0]} {exp.shape} it must be {want}",
                    src.file_for(part.key),
                ))
    for key, exp in m.loads.items():
        md = src.tensors[key]
        if tuple(md.size) != exp.shape:
            problems.append(error(
                "TP603",
                f"{key} has shape {tuple(md.size)} in {src.file_for(key)}, the model's is {exp.shape}",
                src.file_for(key),
            ))
        elif md.properties.dtype.is_floating_point != exp.dtype.is_floating_point or (md.properties.dtype == _bool()) != (exp.dtype == _bool()):
            problems.append(error(
                "TP604",
                f"{key} is {str(md.properties.dtype).removeprefix('torch.')} in {src.file_for(key)}, "
                f"the model's is {str(exp.dtype).removeprefix('torch.')}",
                src.file_for(key),
            ))
    return problems


def _bool():
    import torch

    return torch.bool
