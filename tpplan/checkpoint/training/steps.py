"""Training checkpoints: a root directory of step-numbered checkpoints.

    ROOT/step-10/         a complete checkpoint (DCP: model, optimizer, extra)
    ROOT/step-20/
    ROOT/latest           "step-20": written last, after step-20 is in place
    ROOT/.step-30.staging-XXXX   a save in progress, or killed (loads ignore it)
    ROOT/.step-10.spare-XXXX     the step retention dropped: the next save's staging

The job saving here holds an exclusive lock (flock) on ROOT itself from its first
save until it exits, so no lock file is left behind. `latest` is replaced
atomically (tmp, fsync, rename) only after its step's directory was renamed into
place, so it always names a complete checkpoint (Megatron's
`latest_checkpointed_iteration.txt`); without one (a root whose first save was
killed after its rename) the newest step directory whose manifest checks out is
the latest. The K newest steps up to the latest are kept (torchtitan's
`keep_latest_k`); older ones are renamed aside, then removed, all but one: the
spare the next save overwrites (`atomic.py`), so a root holds K + 1 copies
between saves, as many as during one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .atomic import OLD, SPARE, STAGING, recyclable, tidy, write_text
from .complete import MANIFEST, STEP_DIR, manifest_problem
from ..errors import fail

MARKER = "latest"
_DROP = ".drop-"


def check_step(step: int | None, keep: int | None) -> None:
    """ValueError unless `step` is an integer >= 0 (or None) and `keep` one >= 1 given with a step."""
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an integer >= 0, not {step!r}")
    if keep is not None and (step is None or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an integer >= 1 and needs step= (got keep={keep!r}, step={step!r})")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def steps_in(root: str | Path) -> dict[int, Path]:
    """{step: its directory} of the `step-N` directories in `root`."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return {}
    found = {}
    for entry in entries:
        named = STEP_DIR.fullmatch(entry.name)
        if named and entry.is_dir():
            found[int(named.group(1))] = entry
    return found


def is_root(directory: Path, entries: list[str]) -> bool:
    """A training root: a `latest` marker or step directories, and no checkpoint of its own."""
    return MARKER in entries or any(STEP_DIR.fullmatch(e) and (directory / e).is_dir() for e in entries)


def latest(root: Path) -> tuple[Path, int]:
    """(directory, step) of the latest complete checkpoint in the training root; TP600/TP609 if none."""
    marker = root / MARKER
    try:
        recorded = marker.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        recorded = None
    except OSError as exc:
        raise fail("TP600", f"the marker {marker} cannot be read: {exc.strerror or exc}", str(marker)) from None
    if recorded is not None:
        named = STEP_DIR.fullmatch(recorded)
        if not named:
            raise fail("TP609", f"the marker {marker} names {recorded!r}, not a step-N directory", str(marker))
        if not (root / recorded).is_dir():
            raise fail("TP609", f"the marker {marker} names {recorded}, which is missing from {root}", str(marker))
        return root / recorded, int(named.group(1))
    for step, directory in sorted(steps_in(root).items(), reverse=True):
        if manifest_problem(directory) is None:
            return directory, step
    shown = ", ".join(sorted(p.name for p in steps_in(root).values())) or "none"
    raise fail("TP609", f"the training root {root} holds no complete checkpoint (no {MARKER} marker; step directories: {shown})", str(root))


def record(root: str, step: int) -> None:
    """Make step-N the latest: written after its directory is in place."""
    write_text(os.path.join(root, MARKER), f"step-{step}\n")


def retain(root: str, newest: int, keep: int | None) -> list[int]:
    """Remove all but the `keep` newest steps up to `newest` (later ones, of an earlier
    run that went further, are left alone); the newest removed one becomes the root's
    spare when it has none. Returns the steps removed."""
    if keep is None:
        return []
    older = sorted((s for s in steps_in(root) if s <= newest), reverse=True)[keep:]
    spare = any(SPARE in e.name for e in Path(root).iterdir())
    for step in older:
        directory = step_dir(root, step)
        stem = os.path.join(root, f".step-{step}")
        if not spare and recyclable(directory):
            os.rename(directory, f"{stem}{SPARE}{os.getpid()}")  # not synced: a step directory back after a crash is kept or dropped again
            spare = True
            continue
        aside = f"{stem}{_DROP}{os.getpid()}"
        os.rename(directory, aside)  # atomic: a kill mid-removal leaves no half step directory
        shutil.rmtree(aside)
    return older


def clean_root(root: str) -> Path | None:
    """What earlier saves left in the root (`atomic.tidy`): an old copy whose swap was cut
    short (its step directory gone) put back; one recyclable leftover (the spare first)
    returned for this save to reuse; the other staging, dropped and old directories removed."""
    if not os.path.isdir(root):
        return None
    markers = (STAGING, OLD, _DROP, SPARE)
    entries = sorted(e for e in Path(root).iterdir() if e.name.startswith(".step-") and e.is_dir() and any(m in e.name for m in markers))

    def put_back(entry: Path) -> Path | None:
        home = Path(root) / entry.name[1:].split(".", 1)[0]
        return home if OLD in entry.name and not home.exists() and (entry / MANIFEST).exists() else None

    return tidy(entries, put_back)
