"""Atomic saves and training roots in one process (tpplan.models.mlp:tiny): what a
failed or killed save leaves (the previous checkpoint, loadable), incomplete
directories (TP609 before anything is allocated), the `latest` marker and
retention, bad targets (TP608 naming the path), two jobs on one root, and
asynchronous saves."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tpplan import AsyncSave, CheckpointError, load_checkpoint, save_checkpoint
from tpplan.checkpoint.training import atomic
from tpplan.models import mlp

ROOT = Path(__file__).resolve().parent.parent


def model(seed: int):
    torch.manual_seed(seed)
    return mlp.tiny()


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def loads(path, seed_of_truth: int) -> bool:
    got = model(99)
    load_checkpoint(got, path)
    return same(got, model(seed_of_truth))


def failing_write(code: int, text: str):
    def write(*args, **kwargs):
        raise OSError(code, text)
    return write


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_staging_directory(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    save_checkpoint(model(1), tmp_path / "ckpt")
    monkeypatch.setattr(filesystem, "_write_item", failing_write(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(model(2), tmp_path / "ckpt")
    assert f"TP608 saving to '{tmp_path / 'ckpt'}' failed: rank 0: OSError: [Errno 28] No space left on device" in str(info.value)
    assert "the previous checkpoint is left as it was" in str(info.value)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert loads(tmp_path / "ckpt", 1)
    save_checkpoint(model(2), tmp_path / "ckpt")  # then over it: the new one
    assert loads(tmp_path / "ckpt", 2)


def test_a_killed_saves_staging_directory_is_ignored_by_loads_and_removed_by_the_next_save(tmp_path):
    save_checkpoint(model(1), tmp_path / "ckpt")
    left = tmp_path / ".ckpt.staging-x1y2"  # what a save killed half-way leaves: shards, no .metadata
    left.mkdir()
    shutil.copy(next((tmp_path / "ckpt").glob("*.distcp")), left / "__0_0.distcp")
    assert loads(tmp_path / "ckpt", 1)
    with pytest.raises(CheckpointError, match=r"TP609 incomplete checkpoint .*\.ckpt\.staging-x1y2: __0_0\.distcp but no \.metadata \(the save did not finish\)"):
        load_checkpoint(model(3), left)
    save_checkpoint(model(2), tmp_path / "ckpt")
    assert not left.exists() and loads(tmp_path / "ckpt", 2)


def test_without_an_atomic_exchange_the_swap_is_two_renames_and_a_cut_one_is_put_back(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    save_checkpoint(model(1), tmp_path / "ckpt")
    save_checkpoint(model(2), tmp_path / "ckpt")
    spare, = atomic.leftovers(str(tmp_path / "ckpt"))  # the previous copy, kept for the next save to overwrite
    assert loads(tmp_path / "ckpt", 2) and spare.name.startswith(".ckpt.spare-") and loads(spare, 1)
    os.rename(tmp_path / "ckpt", tmp_path / ".ckpt.old-abc")  # killed between the two renames
    assert atomic.clean(str(tmp_path / "ckpt")) == spare  # the next save's first act: put back, the spare to reuse
    assert loads(tmp_path / "ckpt", 2)


def test_the_next_save_overwrites_the_previous_copy_in_place_and_drops_what_it_did_not_write(tmp_path):
    save_checkpoint(model(1), tmp_path / "ckpt")
    save_checkpoint(model(2), tmp_path / "ckpt")
    spare, = atomic.leftovers(str(tmp_path / "ckpt"))
    inode = (spare / "__0_0.distcp").stat().st_ino
    (spare / "__7_0.distcp").write_bytes(b"another world size's shard")
    save_checkpoint(model(3), tmp_path / "ckpt")
    assert (tmp_path / "ckpt/__0_0.distcp").stat().st_ino == inode  # the same file, rewritten: no fresh allocation
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".metadata", ".tpplan-checkpoint.json", "__0_0.distcp"]
    assert set(json.loads((tmp_path / "ckpt/.tpplan-checkpoint.json").read_text())["files"]) == {".metadata", "__0_0.distcp"}
    spare, = atomic.leftovers(str(tmp_path / "ckpt"))
    assert loads(tmp_path / "ckpt", 3) and loads(spare, 2)
    (spare / "model.safetensors").write_bytes(b"x")  # what a model may still map: not overwritten, removed
    save_checkpoint(model(4), tmp_path / "ckpt")
    assert not spare.exists() and loads(tmp_path / "ckpt", 4) and [loads(p, 3) for p in atomic.leftovers(str(tmp_path / "ckpt"))] == [True]


def test_a_training_root_records_the_latest_step_and_keeps_the_newest(tmp_path):
    net = model(1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    for step in (5, 10, 15, 20):
        net(torch.randn(2, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(net, tmp_path, step=step, keep=2, optimizer=optimizer, extra={"pos": step * 4})
    spare = [p.name for p in tmp_path.iterdir() if ".spare-" in p.name]
    assert sorted(p.name for p in tmp_path.iterdir() if ".spare-" not in p.name) == ["latest", "step-15", "step-20"]
    assert len(spare) == 1 and spare[0].startswith(".step-10.spare-")  # step-10 dropped, for step-25 to overwrite
    assert (tmp_path / "latest").read_text() == "step-20\n"
    manifest = json.loads((tmp_path / "step-20/.tpplan-checkpoint.json").read_text())
    assert manifest["step"] == 20 and set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    fresh = model(2)
    info = load_checkpoint(fresh, tmp_path, optimizer=torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert (info.step, info.extra, info.directory) == (20, {"pos": 80}, str(tmp_path / "step-20"))
    assert same(fresh, net)
    assert load_checkpoint(model(3), tmp_path / "step-15").step == 15  # one step, as a plain checkpoint
    (tmp_path / "latest").unlink()  # a first save killed after its rename: the newest complete step
    assert load_checkpoint(model(3), tmp_path).step == 20


def test_incomplete_training_checkpoints_are_tp609_naming_what_is_missing(tmp_path):
    save_checkpoint(model(1), tmp_path, step=1)
    save_checkpoint(model(2), tmp_path, step=2)
    shutil.copy(tmp_path / "step-1/.tpplan-checkpoint.json", tmp_path / "step-2/.tpplan-checkpoint.json")
    with pytest.raises(CheckpointError, match=r"TP609 incomplete checkpoint .*step-2: it holds step 1 \(mixed steps"):
        load_checkpoint(model(3), tmp_path)
    shutil.rmtree(tmp_path / "step-2")
    with pytest.raises(CheckpointError, match=r"TP609 the marker .*latest names step-2, which is missing from"):
        load_checkpoint(model(3), tmp_path)
    (tmp_path / "step-1/__0_0.distcp").unlink()
    (tmp_path / "latest").write_text("step-1\n")
    with pytest.raises(CheckpointError, match=r"TP609 incomplete checkpoint .*step-1: files listed in its manifest are missing: __0_0\.distcp"):
        load_checkpoint(model(3), tmp_path)
    save_checkpoint(model(1), tmp_path / "other", step=1)
    net = model(4)
    with pytest.raises(CheckpointError, match="TP601 the checkpoint .* holds no optimizer state"):
        load_checkpoint(net, tmp_path / "other", optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def test_bad_targets_are_tp608_naming_the_path(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=f"TP608 '{tmp_path / 'file'}' is a file, not a checkpoint directory"):
        save_checkpoint(model(1), tmp_path / "file")
    with pytest.raises(CheckpointError, match=f"TP608 '{tmp_path / 'file'}' is a file, not a checkpoint directory"):
        save_checkpoint(model(1), tmp_path / "file", step=3)
    assert (tmp_path / "file").read_text() == "x"
    if os.geteuid() != 0:  # root writes anywhere: the read-only mount below covers it
        (tmp_path / "ro").mkdir(mode=0o555)
        with pytest.raises(CheckpointError, match=f"TP608 cannot write in '{tmp_path / 'ro'}': Permission denied"):
            save_checkpoint(model(1), tmp_path / "ro" / "ckpt")
    with pytest.raises(ValueError, match="keep must be an integer >= 1 and needs step="):
        save_checkpoint(model(1), tmp_path / "k", keep=2)


def test_two_jobs_saving_to_one_root_the_second_is_refused(tmp_path):
    save_checkpoint(model(1), tmp_path, step=1)  # this process holds the root's lock from now on
    job = textwrap.dedent(f"""
        import torch
        from tpplan import CheckpointError, save_checkpoint
        from tpplan.models import mlp
        try:
            save_checkpoint(mlp.tiny(), {str(tmp_path)!r}, step=2)
        except CheckpointError as exc:
            print(exc)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env, timeout=120).stdout
    assert f"TP608 another job is saving to '{tmp_path}' (pid {os.getpid()} on " in out and "give each job its own checkpoint directory" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"] and loads(tmp_path, 1)


FULL_DISK = """
import json, os, sys, torch
from tpplan import CheckpointError, load_checkpoint, save_checkpoint
from tpplan.models import mlp
where, out = sys.argv[1], {}
def attempt(name, net, path=where, **kw):
    try:
        save_checkpoint(net, path, **kw); out[name] = "saved"
    except CheckpointError as exc:
        out[name] = str(exc)
torch.manual_seed(1); small = mlp.tiny()
attempt("first", small, step=1)
big = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
attempt("full", big, step=2)
attempt("read-only", small, path=sys.argv[2])
check = mlp.tiny(); info = load_checkpoint(check, where)
out["latest"] = info.step
out["equal"] = all(torch.equal(a, b) for a, b in zip(check.state_dict().values(), small.state_dict().values()))
out["entries"] = sorted(os.listdir(where))
print(json.dumps(out))
"""


def test_a_full_disk_and_a_read_only_one_on_a_small_tmpfs(tmp_path):
    mount, read_only = tmp_path / "disk", tmp_path / "ro"
    mount.mkdir()
    read_only.mkdir()
    probe = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if probe.returncode != 0:  # needs root (or a user namespace) and unshare
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()[:200]}")
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    command = (f"mount -t tmpfs -o size=1m tmpfs {mount} && mount -t tmpfs -o ro,size=1m tmpfs {read_only} && "
               f"{sys.executable} {script} {mount} {read_only / 'ckpt'}")  # a private mount namespace: gone with the process
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["first"] == "saved"
    assert f"TP608 saving to '{mount / 'step-2'}' failed: rank 0: " in out["full"]
    assert f"the file system of '{mount}' is full (0 bytes free)" in out["full"] or "No space left on device" in out["full"]
    assert f"TP608 cannot create the lock file '{read_only / '.ckpt.lock'}': Read-only file system" in out["read-only"]
    assert (out["latest"], out["equal"], out["entries"]) == (1, True, ["latest", "step-1"])


def test_an_asynchronous_save_holds_the_state_of_its_call_and_the_next_save_waits(tmp_path):
    net = model(1)
    handle = save_checkpoint(net, tmp_path, step=1, async_save=True, extra={"n": 1})
    assert isinstance(handle, AsyncSave) and handle.step == 1
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # training goes on: the checkpoint keeps the values of the call
    second = save_checkpoint(net, tmp_path, step=2, async_save=True)  # waits for the first
    assert handle.done() and handle.wait() == str(tmp_path / "step-1")
    assert second.wait() == str(tmp_path / "step-2") and (tmp_path / "latest").read_text() == "step-2\n"
    assert loads(tmp_path / "step-1", 1) and not loads(tmp_path / "step-2", 1)


def test_a_failed_asynchronous_save_raises_at_wait_and_leaves_the_previous(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    save_checkpoint(model(1), tmp_path, step=1)
    monkeypatch.setattr(filesystem, "_write_item", failing_write(errno.EIO, "Input/output error"))
    handle = save_checkpoint(model(2), tmp_path, step=2, async_save=True)
    with pytest.raises(CheckpointError, match=f"TP608 saving to '{tmp_path / 'step-2'}' failed: .*Input/output error"):
        handle.wait()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"] and loads(tmp_path, 1)


def test_no_lock_file_is_left_by_plain_training_and_asynchronous_saves(tmp_path):
    save_checkpoint(model(1), tmp_path / "plain")
    save_checkpoint(model(2), tmp_path / "plain-async", async_save=True).wait()
    save_checkpoint(model(3), tmp_path / "root", step=1)
    save_checkpoint(model(4), tmp_path / "root-async", step=1, async_save=True).wait()
    save_checkpoint(model(5), tmp_path / "root-async", step=2, async_save=True).wait()
    assert [p for p in tmp_path.rglob("*") if "lock" in p.name] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "plain-async", "root", "root-async"]
    assert sorted(p.name for p in (tmp_path / "root-async").iterdir() if ".spare-" not in p.name) == ["latest", "step-1", "step-2"]
    assert loads(tmp_path / "plain", 1) and loads(tmp_path / "plain-async", 2) and loads(tmp_path / "root", 3) and loads(tmp_path / "root-async", 5)


def test_a_plain_save_is_refused_while_another_job_holds_its_lock_file_and_runs_once_it_is_gone(tmp_path):
    lock = str(tmp_path / ".ckpt.lock")
    atomic.acquire(lock, keep=False)  # this process is saving to tmp_path/ckpt
    job = textwrap.dedent(f"""
        from tpplan import CheckpointError, save_checkpoint
        from tpplan.models import mlp
        try:
            print(save_checkpoint(mlp.tiny(), {str(tmp_path / 'ckpt')!r}))
        except CheckpointError as exc:
            print(exc)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    refused = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env, timeout=120).stdout
    assert f"TP608 another job is saving to '{tmp_path}' (pid {os.getpid()} on " in refused and f"holds '{lock}'" in refused
    atomic.release(lock)
    assert not os.path.exists(lock)
    saved = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env, timeout=120).stdout
    assert saved.strip() == str(tmp_path / "ckpt") and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_lock_file_removed_between_open_and_flock_is_not_trusted(tmp_path, monkeypatch):
    lock = str(tmp_path / ".ckpt.lock")
    real_open, opened = os.open, []

    def open_then_removed(path, flags, *mode):
        fd = real_open(path, flags, *mode)
        opened.append(os.fstat(fd).st_ino)
        if len(opened) == 1:
            os.unlink(path)  # the previous holder releasing: its file goes before our flock
        return fd

    monkeypatch.setattr(os, "open", open_then_removed)
    atomic.acquire(lock, keep=False)
    monkeypatch.undo()
    fd = atomic._HELD[os.path.realpath(lock)][0]
    assert len(opened) == 2 and os.fstat(fd).st_ino == os.stat(lock).st_ino == opened[1]
    atomic.release(lock)
    assert not os.path.exists(lock)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_checkpoint_directories_and_files_honour_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        save_checkpoint(model(1), tmp_path / "new" / "plain")  # its parent created too
        save_checkpoint(model(1), tmp_path / "new" / "plain")  # the second save: into the first one's spare
        save_checkpoint(model(2), tmp_path / "hf", format="hf")
        save_checkpoint(model(3), tmp_path / "root", step=1, async_save=True).wait()
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert {m for p, m in modes.items() if (tmp_path / p).is_dir()} == {0o777 & ~umask}, modes
    assert {m for p, m in modes.items() if (tmp_path / p).is_file()} == {0o666 & ~umask}, modes
    assert {"new", "new/plain", "new/plain/__0_0.distcp", "hf", "hf/model-00001-of-00001.safetensors", "root", "root/latest", "root/step-1",
            "root/step-1/.metadata"} <= set(modes)


def test_where_a_directory_cannot_be_flocked_a_training_root_is_locked_by_a_file_for_the_save(tmp_path, monkeypatch):
    import fcntl

    real_flock, taken = fcntl.flock, []

    def no_directories(fd, operation):  # NFS: flock is a POSIX lock, which a directory (read-only) cannot take
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        if operation & fcntl.LOCK_EX:
            taken.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_directories)
    save_checkpoint(model(1), tmp_path, step=1)
    save_checkpoint(model(2), tmp_path, step=2, async_save=True).wait()
    monkeypatch.undo()
    assert taken == [str(tmp_path / ".lock")] * 2 and os.path.realpath(tmp_path) not in atomic._HELD
    assert sorted(p.name for p in tmp_path.iterdir() if ".spare-" not in p.name) == ["latest", "step-1", "step-2"] and loads(tmp_path, 2)
