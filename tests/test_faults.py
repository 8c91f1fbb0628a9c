"""Faults injected into the runtime's files, directories and process: every fault ends in one
clear line (naming the file and the unit) or in gradients equal to plain PyTorch's, never in
silently wrong ones, and nothing is left on disk (docs/reliability.md, "Runtime faults").

Signals and timing: every wait here is for an event (a line on a pipe, a process's exit)
with a deadline far above what it takes on a loaded 2-core host, never a fixed sleep.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import plan_for
from planner.errors import UserError
from planner.formats import Home, Tier
from planner.models import build_model, load_config, make_inputs
from runtime import apply_plan
from runtime.files import MADE, NvmeDirError, OffloadCorrupted, OffloadError

REPO = Path(__file__).resolve().parents[1]
B, S, LAYERS = 2, 16, 4
CFG = dict(load_config("gpt-tiny"), n_layers=LAYERS, dtype="fp32")


def _model(seed=0):
    torch.manual_seed(seed)
    return build_model(CFG, dtype="fp32")


def _inputs(k=0):
    return make_inputs(CFG, B, S, seed=k)


def _plain_grads(steps=1):
    m = _model()
    torch.manual_seed(7)
    m(**_inputs()).loss.backward()
    return [p.grad.clone() for p in m.parameters()]


def _maxdiff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _bins(d: Path):
    return sorted(p for p in d.rglob("*.bin") if p.is_file())


def _drain(h):
    """Wait until the runtime's I/O queue is empty (its thread runs jobs in order)."""
    store = h._r.mover.store
    if store is not None and store.pool is not None:
        store.pool.submit(lambda: None).result()


def _one_line(msg: str):
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------- corrupted files

def _corrupt(path: Path, fault: str) -> None:
    data = bytearray(path.read_bytes())
    if fault == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif fault == "flip":                  # one bit of one byte in the middle
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif fault == "zeros":
        path.write_bytes(bytes(len(data)))
    elif fault == "truncate":
        os.truncate(path, len(data) // 3)
    elif fault == "delete":                # the name goes; the runtime's open file stays
        path.unlink()
    elif fault == "append":                # bytes after what was written are never read
        with open(path, "ab") as f:
            f.write(b"\xff" * 4096)
    else:
        raise AssertionError(fault)


@pytest.mark.parametrize("fault,caught", [("garbage", True), ("flip", True), ("zeros", True),
                                          ("truncate", True), ("delete", False),
                                          ("append", False)])
def test_offload_file_changed_between_forward_and_backward(tmp_path, fault, caught):
    """An activation file changed on disk after it was written: the backward stops with one
    line naming the file and the unit, or (a change that loses nothing) matches PyTorch."""
    g0 = _plain_grads()
    nvme = tmp_path / "n"
    m = _model()
    h = apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=nvme))
    torch.manual_seed(7)
    out = m(**_inputs())
    _drain(h)
    files = {p.name.rsplit("-", 1)[0]: p for p in _bins(nvme)}
    assert set(files) == {f"blocks.{i}" for i in range(LAYERS)}
    victim = files["blocks.1"]
    _corrupt(victim, fault)
    if caught:
        with pytest.raises(OffloadCorrupted) as e:
            out.loss.backward()
        msg = _one_line(str(e.value))
        assert str(victim) in msg and "'blocks.1'" in msg and "training stopped" in msg
        if fault == "truncate":
            assert "truncated" in msg
        else:
            assert "checksum" in msg
        # the unit's gradients were never computed from the bad bytes: blocks.1 and every
        # unit before it have none
        assert all(p.grad is None for p in m.blocks[1].parameters())
        assert all(p.grad is None for p in m.blocks[0].parameters())
        del out
    else:
        out.loss.backward()
        assert _maxdiff([p.grad for p in m.parameters()], g0) <= 1e-6
    h.remove()
    assert not nvme.exists(), list(nvme.rglob("*"))


def test_checkpoint_file_corruption_is_caught(tmp_path):
    """A recompute checkpoint kept on NVMe, changed on disk: caught when read back."""
    m = _model()
    layers = [("recompute", "nvme"), ("recompute", "none"), ("keep", None), ("keep", None)]
    h = apply_plan(m, plan_for(m, layers, B, S, nvme_dir=tmp_path / "n"))
    out = m(**_inputs())
    _drain(h)
    (ck,) = _bins(tmp_path / "n")
    assert ck.name.startswith("ck-blocks.0")
    _corrupt(ck, "flip")
    with pytest.raises(OffloadCorrupted, match="recompute checkpoint of unit 'blocks.0'") as e:
        out.loss.backward()
    _one_line(str(e.value))
    del out
    h.remove()
    assert not (tmp_path / "n").exists()


def _remove_after_fault(h, what):
    """remove() cannot put a corrupted home copy back either, and says so the same way, in
    one line, after cleaning up everything else: every file and folder is gone (they stayed
    until exit before) and the model is free for another plan."""
    with pytest.raises(OffloadCorrupted, match=what) as e:
        h.remove()
    _one_line(str(e.value))
    assert h._r.model not in _active()


def _active():
    from runtime.apply import _ACTIVE
    return _ACTIVE


def _streamed(tmp_path, home: Home, micro_batches=1):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    plan = plan_for(m, "keep-all", B, S, nvme_dir=tmp_path / "n", homes={"blocks": home},
                    micro_batches=micro_batches)
    return m, opt, apply_plan(m, plan, optimizer=opt)


def test_streamed_weights_file_corruption_is_caught(tmp_path):
    """Weights at home on NVMe, changed on disk between two steps: the next forward stops."""
    m, opt, h = _streamed(tmp_path, Home(Tier.NVME, Tier.GPU, Tier.GPU, Tier.GPU))
    m(**_inputs()).loss.backward()
    opt.step()
    opt.zero_grad()
    _drain(h)
    w = [p for p in _bins(tmp_path / "n") if p.name.startswith("w-blocks.2")]
    assert len(w) == 1
    _corrupt(w[0], "garbage")
    with pytest.raises(OffloadCorrupted, match="weights of unit 'blocks.2'") as e:
        m(**_inputs(1)).loss.backward()
    _one_line(str(e.value))
    _remove_after_fault(h, "weights of unit 'blocks.2'")
    assert not (tmp_path / "n").exists()


def test_streamed_gradient_accumulator_corruption_is_caught(tmp_path):
    """Gradients accumulated on NVMe over two micro-batches, the accumulator changed between
    them: the second pass stops instead of adding to garbage."""
    m, opt, h = _streamed(tmp_path, Home(Tier.GPU, Tier.NVME, Tier.GPU, Tier.GPU), 2)
    (m(**_inputs()).loss / 2).backward()
    for s in h._r.statics.values():
        s.wait()
    _drain(h)
    g = [p for p in _bins(tmp_path / "n") if p.name.startswith("g-blocks.1")]
    assert len(g) == 1
    _corrupt(g[0], "zeros")
    with pytest.raises(OffloadCorrupted, match="gradients of unit 'blocks.1'") as e:
        (m(**_inputs(1)).loss / 2).backward()
        for s in h._r.statics.values():
            s.wait()
    _one_line(str(e.value))
    _remove_after_fault(h, "gradients of unit 'blocks.1'")
    assert not (tmp_path / "n").exists()


def test_streamed_optimizer_state_corruption_is_caught(tmp_path):
    m, opt, h = _streamed(tmp_path, Home(Tier.GPU, Tier.GPU, Tier.NVME, Tier.GPU))
    m(**_inputs()).loss.backward()
    opt.step()
    opt.zero_grad()
    _drain(h)
    st = [p for p in _bins(tmp_path / "n") if p.name.startswith("s-blocks.3")]
    assert len(st) == 1
    _corrupt(st[0], "flip")
    m(**_inputs(1)).loss.backward()
    with pytest.raises(OffloadCorrupted, match="optimizer state of unit 'blocks.3'") as e:
        opt.step()
    _one_line(str(e.value))
    _remove_after_fault(h, "optimizer state of unit 'blocks.3'")
    assert not (tmp_path / "n").exists()


def test_streaming_without_faults_still_matches_pytorch(tmp_path):
    """The checksums change nothing when nothing is wrong: weights, gradients and state all
    at home on NVMe, two steps, the same weights as plain PyTorch."""
    ref = _model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for k in range(2):
        ref(**_inputs(k)).loss.backward()
        ropt.step()
        ropt.zero_grad()
    m, opt, h = _streamed(tmp_path, Home(Tier.NVME, Tier.NVME, Tier.NVME, Tier.GPU))
    for k in range(2):
        m(**_inputs(k)).loss.backward()
        opt.step()
        opt.zero_grad()
    h.remove()
    assert _maxdiff(list(m.parameters()), list(ref.parameters())) <= 1e-6
    assert not (tmp_path / "n").exists()


# ----------------------------------------------------------------------------- directories

def test_nvme_dir_that_is_a_file_is_refused_up_front(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine")
    m = _model()
    for nvme in (f, f / "sub"):
        with pytest.raises(NvmeDirError, match="is not a directory") as e:
            apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=nvme))
        assert str(f) in _one_line(str(e.value))
    assert f.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["afile"]
    apply_plan(m, plan_for(m, "keep-all", B, S)).remove()   # nothing was left applied


def _unwritable_dir(tmp_path) -> Path | None:
    """A directory this process cannot create anything in."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d
    for cand in ("/sys/kernel", "/sys/fs", "/proc/self"):   # root: a file system that refuses
        try:
            os.mkdir(os.path.join(cand, "tierplan-probe"))
        except OSError:
            return Path(cand)
        os.rmdir(os.path.join(cand, "tierplan-probe"))
    return None


def test_unwritable_nvme_dir_is_refused_up_front(tmp_path):
    ro = _unwritable_dir(tmp_path)
    if ro is None:
        pytest.skip("no directory here refuses this user's writes")
    m = _model()
    for nvme in (ro, ro / "missing"):
        with pytest.raises(NvmeDirError) as e:
            apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=nvme))
        msg = _one_line(str(e.value))
        assert str(ro) in msg and ("not writable" in msg or "cannot create" in msg)


def test_a_directory_whose_file_system_refuses_new_directories_is_named_so(tmp_path):
    """/proc/self exists but answers mkdir with 'no such file or directory': the store retried
    as if another process kept removing it, then said so; it says what the directory is."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    m = _model()
    with pytest.raises(NvmeDirError) as e:
        apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir="/proc/self"))
    msg = _one_line(str(e.value))
    assert "no directory can be created in it" in msg and "disappearing" not in msg


def test_too_little_room_is_refused_up_front(tmp_path):
    """A disk without room for the plan's NVMe peak: refused by apply_plan, before a forward
    that would fill the disk and fail only at the backward."""
    m = _model()
    plan = plan_for(m, "offload-all", B, S, nvme_dir=tmp_path / "n")
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    big = dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, peak_nvme_bytes=free + 2**40))
    with pytest.raises(NvmeDirError, match="bytes free but") as e:
        apply_plan(m, big)
    _one_line(str(e.value))
    assert os.listdir(tmp_path) == []           # the folder it made is gone again
    h = apply_plan(m, plan)                     # and the model is free for the next try
    h.remove()


def _disk_fills_after(n: int, monkeypatch, failed: set | None = None):
    """Every ``os.pwrite`` after the first ``n`` fails with ENOSPC (its fd into ``failed``);
    returns the real one."""
    real = os.pwrite
    written = [0]

    def pwrite(fd, data, offset):
        written[0] += 1
        if written[0] > n:
            if failed is not None:
                failed.add(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", pwrite)
    return real


def test_disk_full_during_forward_stops_with_one_line(tmp_path, monkeypatch):
    """The disk fills after the up-front check: the write fails at the next stage of the
    forward, one line naming the file, and nothing is left."""
    m = _model()
    h = apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=tmp_path / "n"))
    real = _disk_fills_after(3, monkeypatch)
    with pytest.raises(OffloadError, match="disk is full") as e:
        m(**_inputs()).loss.backward()
    msg = _one_line(str(e.value))
    assert "cannot write offload file" in msg and "activations of unit 'blocks." in msg
    monkeypatch.setattr(os, "pwrite", real)
    h.remove()
    assert not (tmp_path / "n").exists()


def test_disk_full_in_a_pipelined_optimizer_phase_stops_with_one_line(tmp_path, monkeypatch):
    """The disk fills while the optimizer phase writes one unit home and reads the next
    (optimizer depth 3): opt.step() stops with the write's one line, nothing fetched ahead
    stays on the device, and remove() leaves nothing."""
    m, opt, h = _streamed(tmp_path, Home(Tier.NVME, Tier.NVME, Tier.NVME, Tier.GPU))
    assert h.plan.optimizer_depth == 3
    m(**_inputs()).loss.backward()
    opt.step()                                   # the first step writes every state file
    opt.zero_grad()
    m(**_inputs(1)).loss.backward()
    _drain(h)
    fds: set = set()
    real = _disk_fills_after(5, monkeypatch, fds)
    with pytest.raises(OffloadError, match="disk is full") as e:
        opt.step()
    _one_line(str(e.value))
    monkeypatch.setattr(os, "pwrite", real)
    # a unit whose write failed keeps its weights (its home is half written: the one
    # writing behind and the one stepping may both have failed); no other unit's weights,
    # read ahead for its step or written home, stay on the device
    failed = [u for u in h._r.statics.values() if u.in_use]
    assert 1 <= len(failed) <= 2
    assert all(fds & {u.w_fd, u.s_fd, u.g_fd} for u in failed), [u.name for u in failed]
    for u in h._r.statics.values():
        assert u.grads_ahead is None
        if u not in failed:
            assert all(p.untyped_storage().nbytes() == 0 for _, p in u.params), u.name
    with contextlib.suppress(OffloadError):
        h.remove()                               # a unit's home may be half written
    assert h._r.model not in _active()
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("n", range(1, 9))
def test_one_failed_write_in_a_pipelined_optimizer_phase_keeps_only_its_units_weights(
        tmp_path, monkeypatch, n):
    """Only the n-th write of the phase fails (a transient error): the one unit whose home it
    was keeps its weights; the unit stepping beside it, whose own writes went home, does not
    (when the error came from the write behind, that unit's write-back was dropped and its
    weights stayed on the device for good)."""
    m, opt, h = _streamed(tmp_path, Home(Tier.NVME, Tier.NVME, Tier.NVME, Tier.GPU))
    m(**_inputs()).loss.backward()
    opt.step()
    opt.zero_grad()
    m(**_inputs(1)).loss.backward()
    _drain(h)
    real, count, fds = os.pwrite, [0], set()

    def pwrite(fd, data, offset):
        count[0] += 1
        if count[0] == n:
            fds.add(fd)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OffloadError, match="cannot write offload file") as e:
        opt.step()
    _one_line(str(e.value))
    monkeypatch.setattr(os, "pwrite", real)
    kept = [u.name for u in h._r.statics.values() if u.in_use]
    assert kept == [u.name for u in h._r.statics.values() if fds & {u.w_fd, u.s_fd, u.g_fd}]
    with contextlib.suppress(OffloadError):
        h.remove()
    assert not (tmp_path / "n").exists()


# ----------------------------------------------------------------------------- processes

CHILD = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {tests!r})
    from conftest import plan_for
    from planner.models import build_model, load_config, make_inputs
    from runtime import apply_plan
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=4)
    torch.manual_seed(0)
    model = build_model(cfg, dtype="fp32")
    h = apply_plan(model, plan_for(model, "offload-all", 2, 16, nvme_dir={nvme!r}))
    mode = {mode!r}
    if mode == "train":
        for k in range(3):
            model(**make_inputs(cfg, 2, 16, seed=k)).loss.backward()
        h.remove()
        print("DONE", flush=True)
        sys.exit(0)
    out = model(**make_inputs(cfg, 2, 16))
    def slow(g):
        print("IN_BACKWARD", h._r.mover.store.dir, flush=True)
        time.sleep(600)
    out.logits.register_hook(slow)
    out.loss.backward()
""")


def _terminal_sigint() -> None:
    """In the child before it starts: SIGINT as at a terminal. A test run started in the
    background by a non-interactive shell inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: Ctrl-C would be ignored, as that shell intends, and the test
    would wait for an exit that never comes (it did, beside a busy core, in a backgrounded
    run of the suite)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(nvme, mode):
    code = CHILD.format(tests=str(REPO / "tests"), nvme=str(nvme), mode=mode)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            preexec_fn=_terminal_sigint)


def _read_line(proc, timeout=300.0) -> str:
    """The child's next stdout line, waiting at most ``timeout`` (a loaded host is slow to
    import torch; a hung child must not hang the suite)."""
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    if not r:
        proc.kill()
        raise AssertionError(f"no line within {timeout} s; stderr: {proc.stderr.read()[-2000:]}")
    return proc.stdout.readline()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_no_file_left_after_a_signal_during_backward(tmp_path, sig):
    """SIGTERM is handled like SIGINT: the training loop unwinds and every file and every
    folder the runtime made is gone."""
    nvme = tmp_path / "deep" / "nvme"
    proc = _spawn(nvme, "hang")
    line = _read_line(proc)
    assert line.startswith("IN_BACKWARD"), (line, proc.stderr.read())
    assert _bins(nvme), "the offload files exist while the backward runs"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert ("Terminated" if sig == signal.SIGTERM else "KeyboardInterrupt") in err
    assert not (tmp_path / "deep").exists(), list(tmp_path.rglob("*"))


def test_sigkilled_run_is_swept_by_the_next(tmp_path):
    """SIGKILL leaves the directory and its files; the next run under the same nvme_dir
    removes them (its owner's lock is free), and leaves what is not the runtime's."""
    nvme = tmp_path / "n"
    nvme.mkdir()
    (nvme / "mine.txt").write_text("not the runtime's")
    proc = _spawn(nvme, "hang")
    line = _read_line(proc)
    assert line.startswith("IN_BACKWARD"), (line, proc.stderr.read())
    stale = Path(line.split()[1])
    assert stale.is_dir() and list(stale.glob("*.bin"))
    proc.kill()
    proc.wait(timeout=300)
    assert stale.is_dir(), "SIGKILL cannot clean up; the next run must"
    # a live process's directory is never swept: start one and keep it running meanwhile
    live = _spawn(nvme, "hang")
    live_dir = Path(_read_line(live).split()[1])
    m = _model()
    h = apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=nvme))
    assert not stale.exists()
    assert live_dir.is_dir() and list(live_dir.glob("*.bin"))
    m(**_inputs()).loss.backward()
    h.remove()
    live.kill()
    live.wait(timeout=300)
    assert (nvme / "mine.txt").read_text() == "not the runtime's"


def test_processes_sharing_a_missing_nvme_dir_do_not_collide(tmp_path):
    """Four processes train at once under one nvme_dir that does not exist: each gets its own
    directory, none fails, and the folders they made are gone when the last one leaves."""
    nvme = tmp_path / "shared" / "nvme"
    procs = [_spawn(nvme, "train") for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and "DONE" in out, err[-2000:]
    assert not (tmp_path / "shared").exists(), list(tmp_path.rglob("*"))


def test_existing_folder_marked_by_nobody_is_kept(tmp_path):
    """A folder that existed is never removed, empty or not; a folder the runtime made is,
    and only while it holds nothing but its mark."""
    m = _model()
    keep = tmp_path / "exists"
    keep.mkdir()
    h = apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=keep / "made"))
    assert (keep / "made" / MADE).is_dir()
    m(**_inputs()).loss.backward()
    (keep / "made" / "user-file.txt").write_text("x")      # someone else's file appears
    h.remove()
    assert keep.is_dir() and (keep / "made" / "user-file.txt").exists()


# ----------------------------------------------------------------------------- the sweeper

def _fake_runtime_dir(base: Path, pid: int, start: str | None, files=("a-0123abcd.bin",)):
    """A directory as a runtime process makes it (owner file, manifest listing ``files``),
    with its lock free, as if its process had ended without cleaning up."""
    from runtime import files as rf
    d = base / f"tierplan-{pid}-0badcafe"
    d.mkdir(parents=True)
    text = rf._owner_text(pid)
    if start is not None:
        text = "\n".join(f"start={start}" if ln.startswith("start=") else ln
                         for ln in text.splitlines()) + "\n"
    (d / rf.OWNER).write_text(text)
    lines = [rf._MANIFEST_HEAD]
    for name in files:
        (d / name).write_bytes(b"x" * 100)
        lines.append(f"+{name} {(d / name).stat().st_ino}")
    (d / rf.MANIFEST).write_text("\n".join(lines) + "\n")
    return d


def test_sweep_keeps_a_users_files_named_like_the_runtimes(tmp_path):
    """A folder named like the runtime's without its owner file is nobody's to sweep: a
    user's ``*-<8 hex>.bin`` in it and a ``.tierplan-*.new`` folder older than a minute, with
    a user's file in it, are kept."""
    from runtime.files import sweep
    nvme = tmp_path / "n"
    mine = nvme / "tierplan-4194303-deadbeef"
    mine.mkdir(parents=True)
    (mine / "results-0123abcd.bin").write_bytes(b"user data")
    new = nvme / ".tierplan-4194303-cafebabe.new"
    new.mkdir()
    (new / "notes.txt").write_text("user notes")
    old = time.time() - 3600
    for p in (mine, new):
        os.utime(p, (old, old))
    assert sweep(nvme) == []
    m = _model()
    h = apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=nvme))
    m(**_inputs()).loss.backward()
    h.remove()
    assert (mine / "results-0123abcd.bin").read_bytes() == b"user data"
    assert (new / "notes.txt").read_text() == "user notes"


def test_sweep_deletes_a_dead_runs_files_but_not_a_users_file_beside_them(tmp_path):
    """After a SIGKILL the next sweep deletes exactly the files the dead run recorded
    creating: a user's file dropped into its directory stays, and so does the directory,
    until the user takes the file away."""
    from runtime.files import sweep
    nvme = tmp_path / "n"
    proc = _spawn(nvme, "hang")
    line = _read_line(proc)
    assert line.startswith("IN_BACKWARD"), (line, proc.stderr.read())
    stale = Path(line.split()[1])
    ours = sorted(stale.glob("*.bin"))
    assert ours
    proc.kill()
    proc.wait(timeout=300)
    (stale / "mine-0123abcd.bin").write_bytes(b"user data")
    assert sweep(nvme) == []
    assert not any(p.exists() for p in ours)
    assert (stale / "mine-0123abcd.bin").read_bytes() == b"user data"
    (stale / "mine-0123abcd.bin").unlink()
    assert sweep(nvme) == [str(stale)] and not stale.exists()


def test_sweep_tells_a_live_owner_from_a_reused_pid(tmp_path):
    """A free lock alone does not prove the owner gone: a directory whose owner file names a
    running process (pid and start time) is kept; the same pid with another start time is a
    reused pid, and that directory is swept."""
    from runtime.files import _proc_start, sweep
    live = _fake_runtime_dir(tmp_path / "a", os.getppid(), None)    # pytest's parent runs
    assert _proc_start(os.getppid()) is not None
    assert sweep(tmp_path / "a") == []
    assert (live / "a-0123abcd.bin").exists()
    reused = _fake_runtime_dir(tmp_path / "b", os.getppid(), "1")
    assert sweep(tmp_path / "b") == [str(reused)] and not reused.exists()
    # a file moved over the recorded one (another inode) is not the one that was created
    other = _fake_runtime_dir(tmp_path / "c", os.getppid(), "1")
    (tmp_path / "users.bin").write_text("the user's now")
    os.replace(tmp_path / "users.bin", other / "a-0123abcd.bin")
    assert sweep(tmp_path / "c") == []
    assert (other / "a-0123abcd.bin").read_text() == "the user's now"


# a 4-block model under offload-all, one forward issued: the parent of the fork tests
FORK_START = textwrap.dedent("""
    import concurrent.futures, gc, os, sys, time, torch
    sys.path.insert(0, {tests!r})
    from conftest import plan_for
    from planner.models import build_model, load_config, make_inputs
    from runtime import apply_plan
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=4)
    torch.manual_seed(0)
    model = build_model(cfg, dtype="fp32")
    h = apply_plan(model, plan_for(model, "offload-all", 2, 16, nvme_dir={nvme!r}))
    out = model(**make_inputs(cfg, 2, 16))
""")

FORK = FORK_START + textwrap.dedent("""
    d = h._r.mover.store.dir
    before = sorted(os.listdir(d))
    pid = os.fork()
    if pid == 0:          # the child drops everything and exits normally (atexit runs)
        del out, h
        gc.collect()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert sorted(os.listdir(d)) == before, (before, os.listdir(d))
    out.loss.backward()
    model(**make_inputs(cfg, 2, 16, seed=1)).loss.backward()
    h.remove()
    assert not os.path.exists(d)
    print("PARENT OK", flush=True)
""")


def test_a_forked_childs_exit_leaves_the_parents_files(tmp_path):
    """A child forked mid-step (a DataLoader worker, os.fork) that exits normally deletes
    nothing of its parent's: the parent's backward and next step run, and its remove()
    cleans up."""
    code = FORK.format(tests=str(REPO / "tests"), nvme=str(tmp_path / "n"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=300)
    assert r.returncode == 0 and "PARENT OK" in r.stdout, r.stderr[-3000:]
    assert not (tmp_path / "n").exists()


FORK_IN_FLIGHT = FORK_START + textwrap.dedent("""
    # the fork lands while the parent's I/O thread still has a write of every group in flight
    # and is inside one group's lock and the counters' lock: neither the thread nor its
    # futures exist in the child
    groups = [o for o in gc.get_objects() if type(o).__name__ == "Group" and o.futures]
    assert groups, "no offload group with I/O issued"
    pending = [concurrent.futures.Future() for _ in groups]
    for g, f in zip(groups, pending):
        g.futures.append(f)
    groups[0].lock.acquire()
    groups[0].m.counters.lock.acquire()
    pid = os.fork()
    if pid == 0:
        del out, h, groups
        gc.collect()
        sys.exit(0)
    groups[0].lock.release()
    groups[0].m.counters.lock.release()
    for f in pending:
        f.set_result(None)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("CHILD HUNG", flush=True)
            sys.exit(1)
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, status
    out.loss.backward()
    h.remove()
    print("PARENT OK", flush=True)
""")


def test_a_forked_child_does_not_wait_for_the_parents_io(tmp_path):
    """A child forked while the parent's I/O thread has writes in flight (and holds a group's
    lock) exits at once: it neither waits for futures no thread of its own will finish nor
    takes a lock that only the parent's thread can release. Before, its exit hung in
    ``Group.wait`` whenever a write was in flight at the fork (one run in four under load)."""
    code = FORK_IN_FLIGHT.format(tests=str(REPO / "tests"), nvme=str(tmp_path / "n"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=300)
    assert r.returncode == 0 and "PARENT OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert not (tmp_path / "n").exists()


def test_a_forked_child_cannot_write_the_parents_files(tmp_path):
    """In a forked child the store refuses every use (its files are the parent's), in one
    line; the parent is unaffected."""
    m = _model()
    h = apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=tmp_path / "n"))
    store = h._r.mover.store
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            store.open("x")
        except OffloadError as e:
            code = 0 if "was forked from process" in str(e) and "\n" not in str(e) else 2
        except BaseException:
            code = 3
        store.close()
        os._exit(code)
    deadline = time.monotonic() + 300
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child did not finish within 300 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    m(**_inputs()).loss.backward()
    h.remove()
    assert not (tmp_path / "n").exists()


# ----------------------------------------------------------------------------- unclean errors

def test_read_only_nvme_dir_at_remove_is_one_line_and_nothing_is_dropped(tmp_path, monkeypatch):
    """The NVMe directory turns read-only mid-run (deletions refused): remove() still brings
    every weight home and deletes what it can, then says in one line which file it could
    not delete; that file stays recorded, and once the directory is writable again the next
    sweep deletes it (before: a raw PermissionError, the file dropped from the list)."""
    from runtime.files import sweep
    m, opt, h = _streamed(tmp_path, Home(Tier.NVME, Tier.GPU, Tier.NVME, Tier.GPU))
    ref = list(_model().parameters())          # the same weights (seed 0), not stepped
    m(**_inputs()).loss.backward()
    _drain(h)
    d = h._r.mover.store.dir
    real = os.unlink

    def unlink(path, *a, **kw):
        if str(path).startswith(str(d)) and str(path).endswith(".bin"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OffloadError, match="cannot delete offload file") as e:
        h.remove()
    msg = _one_line(str(e.value))
    assert "Permission denied" in msg and "next apply_plan" in msg
    monkeypatch.setattr(os, "unlink", real)
    left = _bins(tmp_path / "n")
    assert left, "the files it could not delete are still there"
    assert _maxdiff(list(m.parameters()), ref) == 0.0   # the weights came home all the same
    assert sweep(tmp_path / "n") == [str(d)]
    assert not any(p.exists() for p in left)


def test_failed_mkdir_of_a_deep_nvme_dir_leaves_no_folder(tmp_path, monkeypatch):
    """Creating a missing nvme_dir three levels deep fails at the last level (a full disk):
    one line, and the two folders it made before are removed again."""
    real = os.mkdir

    def mkdir(path, *a, **kw):
        if os.path.basename(os.fspath(path)) == "c":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return real(path, *a, **kw)
    monkeypatch.setattr(os, "mkdir", mkdir)
    m = _model()
    with pytest.raises(NvmeDirError, match="No space left") as e:
        apply_plan(m, plan_for(m, "offload-all", B, S, nvme_dir=tmp_path / "a" / "b" / "c"))
    _one_line(str(e.value))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("nvme", ["", "a\nb", "x/" * 2100, "y" * 300])
def test_nvme_dir_the_os_cannot_take_is_refused_before_anything_is_made(tmp_path, nvme):
    m = _model()
    plan = plan_for(m, "offload-all", B, S, nvme_dir=tmp_path / "n")
    target = nvme and str(tmp_path / nvme)
    with pytest.raises(UserError) as e:      # NvmeDirError; "" names no directory at all
        apply_plan(m, plan, nvme_dir=target)
    _one_line(str(e.value))
    assert os.listdir(tmp_path) == []


def _tmpfs(where: Path, size: int):
    """Mount a tmpfs of ``size`` bytes at ``where`` (root only); None where not allowed."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True)
    return where if r.returncode == 0 else None


def test_room_check_counts_the_file_systems_blocks(tmp_path):
    """A tmpfs one page larger than the plan's NVMe peak, too small once every file is
    rounded up to whole pages: refused up front in one line (it was accepted, then the
    forward ran out of space). A tmpfs with exactly the peak plus one page per planned file
    and the room its manifest may grow to passes the check."""
    from runtime.files import _MANIFEST_LINE_BYTES, _manifest_bound, planned_files
    m = _model()
    plan = plan_for(m, "offload-all", B, S, nvme_dir=tmp_path / "n")
    peak = int(plan.predicted.peak_nvme_bytes)
    mnt = _tmpfs(tmp_path / "mnt", peak + 4096)
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        assert os.statvfs(mnt).f_frsize == 4096
        with pytest.raises(NvmeDirError, match="blocks") as e:
            apply_plan(m, plan, nvme_dir=mnt / "n")
        _one_line(str(e.value))
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    n = planned_files(plan)
    grow = -(-_MANIFEST_LINE_BYTES * (_manifest_bound(n) + 1) // 4096) * 4096
    # + 2 pages: the owner file and the manifest, made before free space is read
    mnt = _tmpfs(tmp_path / "mnt2", peak + 4096 * n + grow + 2 * 4096)
    try:
        apply_plan(m, plan, nvme_dir=mnt / "n").remove()
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
