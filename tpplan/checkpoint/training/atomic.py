"""The file-system half of an atomic save (no torch, no collectives): the staging
directory beside the target, fsync, the rename into place, the lock, leftovers.

    parent/.NAME.staging-XXXX   what a save writes (loads never look at it)
    parent/.NAME.old-XXXX       the previous copy during a swap without an exchange
    parent/.NAME.spare-XXXX     the previous copy after the swap: the next save's staging
    parent/.NAME.lock           a plain save's lock, removed when the save ends (a training root: ROOT itself)

`publish` swaps the staging directory and the target in one `renameat2
(RENAME_EXCHANGE)` (Linux): at every instant `path` is either the old complete
checkpoint or the new one. Where the kernel or file system cannot exchange, it
renames the old copy aside, then the new one in (a kill between the two leaves
the old copy at `.NAME.old-XXXX`, which the next save puts back).

The previous copy is not removed after the swap but kept as a spare
(`recyclable`: DCP shard files, `.metadata` and the manifest only), which the
next save renames into its staging directory and overwrites file by file, as a
save in place would: on ext4 writing fresh files (a new directory, blocks freed
by the removal of the copy before) costs up to 5x the system time of
overwriting the files of a directory in place, and the removal itself was on
the commit's critical path. The spare is never loaded (a hidden name; its
`.metadata` and manifest go first when it is reused, and files the new save did
not write are removed before its manifest lists the directory), so a kill at
any point leaves at most a directory the next save reuses or removes. The cost:
between saves the previous copy stays on disk beside the target (what a save
needs during its write anyway).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

STAGING = ".staging-"
OLD = ".old-"
SPARE = ".spare-"
_DCP_FILES = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?|\.tpplan-checkpoint\.json(\.tmp-\d+)?")
_INVALID_FIRST = (".metadata", ".tpplan-checkpoint.json")  # a reused spare stops looking like a checkpoint
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_HELD: dict[str, tuple[int, bool, str | None]] = {}  # realpath of a lock -> (its open descriptor, kept for life, the lock file to remove)


class SaveRefused(Exception):
    """The target cannot be saved to; the message names the path and why."""


def check_target(target: str) -> None:
    """SaveRefused when `target` is a file or its parent cannot hold a staging directory."""
    p = Path(target)
    if p.exists() and not p.is_dir():
        raise SaveRefused(f"{target!r} is a file, not a checkpoint directory: remove it or save elsewhere")
    parent = p.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SaveRefused(f"{str(parent)!r} is a file: the checkpoint directory {target!r} cannot be created in it") from None
    except OSError as exc:
        raise SaveRefused(f"cannot create {str(parent)!r}: {exc.strerror or exc}") from None


def acquire(lock: str, *, keep: bool) -> None:
    """Take the exclusive lock `lock` (flock: released by the kernel when the process
    dies, so a killed job never leaves a stale lock): a directory that exists is
    locked itself (a training root: no file), any other path is a lock file created
    for the save and removed by `release`. `keep`: held until the process exits (a
    training root: no other job may save there meanwhile). Where the file system
    cannot flock a directory (NFS emulates flock with POSIX locks, which need a file
    open for writing), the directory is locked by `DIR/.lock` for the save alone."""
    key = os.path.realpath(lock)
    if key in _HELD:
        return
    if os.path.isdir(lock):
        fd = _take(lock, directory=True)
        if fd is not None:
            _HELD[key] = (fd, keep, None)
            return
        lock, keep = os.path.join(lock, ".lock"), False
    fd = _take(lock, directory=False)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    _HELD[key] = (fd, keep, lock)


def _take(lock: str, *, directory: bool) -> int | None:
    """The descriptor of `lock` (a directory, or a lock file it creates) flocked
    exclusively; SaveRefused when another process holds it; None when a directory
    cannot be flocked on its file system."""
    import fcntl

    while True:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_DIRECTORY) if directory else os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            what = "lock the directory" if directory else "create the lock file"
            raise SaveRefused(f"cannot {what} {lock!r}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd, directory)
            os.close(fd)
            where = lock if directory else str(Path(lock).parent)
            raise SaveRefused(f"another job is saving to {where!r} ({holder} holds {lock!r}): give each job its own checkpoint directory") from None
        except OSError:
            os.close(fd)
            if directory:
                return None
            raise
        if directory or _same_file(fd, lock):
            return fd
        os.close(fd)  # its holder removed the file between our open and flock: lock the path's file now


def release(lock: str) -> None:
    """Give back a lock taken with keep=False (a kept lock stays until exit); a lock
    file is removed while it is still held, so no other job locks the removed file."""
    import fcntl

    key = os.path.realpath(lock)
    fd, keep, lock_file = _HELD.get(key, (None, True, None))
    if fd is not None and not keep:
        del _HELD[key]
        if lock_file is not None:
            try:
                os.unlink(lock_file)
            except FileNotFoundError:
                pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int, directory: bool) -> str:
    """Who holds the flock on `fd`: what a lock file says ("pid N on HOST"), else the
    pid /proc/locks gives on this host, else "another process"."""
    if not directory:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if text:
            return text
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return "another process"
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 4242 00:2e:1234 0 EOF" (a waiter's line has "->" after "1:")
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            return f"pid {fields[4]} on {socket.gethostname()}"
    return "another process"


def new_staging(target: str, spare: Path | None = None) -> str:
    """The staging directory beside `target` (same file system: the rename is atomic):
    `spare` renamed and emptied of its `.metadata` and manifest, else a fresh one,
    created as `mkdir` would (0777 less the umask: the checkpoint directory it becomes
    is as readable as the user's other directories, not mkdtemp's 0700)."""
    p = Path(target)
    try:
        while True:
            staging = p.parent / f".{p.name}{STAGING}{secrets.token_hex(4)}"
            if spare is None:
                try:
                    os.mkdir(staging)
                except FileExistsError:
                    continue
                return str(staging)
            if not os.path.lexists(staging):
                break
        os.rename(spare, staging)
        for name in _INVALID_FIRST:
            try:
                os.unlink(staging / name)
            except FileNotFoundError:
                pass
        return str(staging)
    except OSError as exc:
        raise SaveRefused(f"cannot write in {str(p.parent)!r}: {exc.strerror or exc}") from None


def recyclable(directory: str | Path) -> bool:
    """Whether a leftover directory may become the next save's staging: it holds only
    DCP shard files, `.metadata` and the manifest (nothing a model may still map,
    no subdirectory)."""
    try:
        with os.scandir(directory) as entries:
            return all(e.is_file(follow_symlinks=False) and _DCP_FILES.fullmatch(e.name) for e in entries)
    except OSError:
        return False


def prune(staging: str, written: set[str]) -> None:
    """Remove the files of a reused spare that this save did not write (another world
    size's shards), before the manifest lists the directory."""
    with os.scandir(staging) as entries:
        stale = [e.path for e in entries if e.name not in written]
    for path in stale:
        os.unlink(path)


def leftovers(target: str) -> list[Path]:
    """Staging, old-copy and spare directories of earlier saves of `target`."""
    p = Path(target)
    prefixes = (f".{p.name}{STAGING}", f".{p.name}{OLD}", f".{p.name}{SPARE}")
    try:
        return sorted(e for e in p.parent.iterdir() if e.name.startswith(prefixes) and e.is_dir())
    except OSError:
        return []


def clean(target: str) -> Path | None:
    """Tidy what earlier saves of `target` left (`tidy`): an old copy whose swap was cut
    short goes back into place when there is no `target`."""
    old = f".{Path(target).name}{OLD}"
    return tidy(leftovers(target), lambda e: Path(target) if e.name.startswith(old) and not os.path.lexists(target) else None)


def tidy(entries: list[Path], put_back: Callable[[Path], Path | None]) -> Path | None:
    """Earlier saves' leftover directories (`entries`, in order): one whose swap was cut
    short goes back where `put_back(entry)` says (None: not such a one); the first
    recyclable one (a spare first) is returned for this save to reuse; the others are
    removed."""
    spare = None
    for entry in sorted(entries, key=lambda e: SPARE not in e.name):
        home = put_back(entry)
        if home is not None:
            os.rename(entry, home)
            fsync_dir(str(home.parent))
        elif spare is None and recyclable(entry):
            spare = entry
        else:
            shutil.rmtree(entry, ignore_errors=True)
    return spare


def fsync_dir(path: str) -> None:
    """Make the directory's entries (files created, renamed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, text: str) -> None:
    """Write the new file `path` and fsync it (its directory entry: the caller's fsync_dir)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_files(directory: str) -> None:
    """fsync every file of `directory` (and the directory): what the writer did not sync itself."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


def publish(staging: str, target: str, *, keep_spare: bool) -> None:
    """Put the complete `staging` directory at `target`, durably. The previous copy
    at `target`, once the new one is in place, becomes the spare (`keep_spare` and
    recyclable) or is removed."""
    parent = str(Path(target).parent)
    if not os.path.lexists(target):
        os.rename(staging, target)
        fsync_dir(parent)
        return
    if _exchange(staging, target):
        previous = staging
    else:
        previous = staging.replace(STAGING, OLD, 1)
        os.rename(target, previous)
        os.rename(staging, target)
    fsync_dir(parent)
    if keep_spare and recyclable(previous):
        os.rename(previous, staging.replace(STAGING, SPARE, 1))  # not synced: lost in a crash, it is a leftover all the same
    else:
        shutil.rmtree(previous)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the system cannot (then nothing moved)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def write_text(path: str, text: str) -> None:
    """Replace the file `path` with `text` atomically and durably (tmp, fsync, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(str(Path(path).parent))
