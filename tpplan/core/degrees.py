"""Which TP degrees a command works at: the one rule every command follows.

Those asked for on the command line (`--tp`), else those the plan promises
(`mesh.sizes`), else the command's own default, which is where commands
genuinely differ (each caller says why it passes what it passes):

- `validate --model` (lint/checks.py): DEFAULT_TP_SIZES, the common degrees;
- `apply --dry-run` and its memory planning (runtime/dryrun.py,
  memory/memory_dryrun.py): none, a missing degree is an error: a simulation
  at a degree nobody named would prove nothing anyone asked;
- `tpplan init --from` (init/fix.py): the degrees that shard the most of the
  model (init/infer.py's default_degrees), computed only when needed;
- `import-hf` (hf/importer.py): no command line and no plan yet; the
  DEFAULT_TP_SIZES that divide the config's head counts and widths
  (`dividing`), so the plan it writes promises only degrees that can work.

Under torchrun the degree is not chosen: the launched world (and --fsdp)
fixes it (runtime/devices.py: `mesh_shape`, `fsdp_tp`), and the plan's mesh.sizes is checked against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["DEFAULT_TP_SIZES", "dividing", "divisors_text", "tp_degrees"]

# The degrees checked when neither the command line nor the plan names any.
DEFAULT_TP_SIZES = (2, 4, 8)


def tp_degrees(asked: Sequence[int] | int | None, promised: Sequence[int] | None,
               default: Sequence[int] | Callable[[], Sequence[int]] = ()) -> list[int]:
    """The degrees `asked` for (one or several; None or empty: none), else those
    `promised` (the plan's mesh.sizes), else `default` (a callable is called only
    here: a default that costs a model's analysis). In the order given; [] when
    all three are empty."""
    if isinstance(asked, int):
        asked = [asked]
    if asked:
        return list(asked)
    if promised:
        return list(promised)
    return list(default() if callable(default) else default)


def dividing(candidates: Iterable[int], sizes: Iterable[object]) -> list[int]:
    """The `candidates` that divide every positive int of `sizes` (others are unknown: ignored)."""
    known = [size for size in sizes if isinstance(size, int) and not isinstance(size, bool) and size > 0]
    return [degree for degree in candidates if all(size % degree == 0 for size in known)]


def divisors_text(size: int, up_to: int | None = None) -> str:
    """'1, 2, 3, 6': the divisors of `size` (those up to `up_to` when given), for the
    fix of a "does not divide" message."""
    top = size if up_to is None else min(size, up_to)
    return ", ".join(str(d) for d in range(1, top + 1) if size % d == 0)
