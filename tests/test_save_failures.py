"""A save that fails in the background — a real full filesystem, a real read-only mount — leaves
training running, earlier checkpoints intact and the failure visible (issue 3, item 6)."""

from __future__ import annotations

import subprocess

import pytest
import torch

import smartckpt_cli as sc


def _mount(args: list[str]) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({r.stderr.strip()}); these faults need a real small filesystem")


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)])
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def bind_dir(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    _mount(["--bind", str(src), str(mnt)])
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.Linear(512, 128))


def _step(model, opt):
    model(torch.randn(8, 128)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_disk_full_keeps_training_and_the_previous_checkpoint(tiny_fs):
    model = _model()  # ~330 KB of weights: fits once in 3 MB, not with AdamW moments many times
    opt = torch.optim.AdamW(model.parameters())
    mgr = sc.CheckpointManager(tiny_fs, keep_last=3, compression_level=-1, every_steps=1)
    mgr.register(model=model)
    _step(model, opt)
    assert mgr.save(1, blocking=True).wait() is not None
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.register(optimizer=opt)  # now each checkpoint is ~1 MB more than the disk has left
    failed_at = None
    for step in range(2, 12):
        _step(model, opt)  # training goes on whatever the saves do
        res = mgr.step(step)
        if res.handle is not None:
            res.handle.wait()
        if mgr.failures:
            failed_at = step
            break
    assert failed_at is not None, "the 3 MB filesystem never filled up"
    assert "No space left on device" in mgr.failures[0] or "ENOSPC" in mgr.failures[0]
    for later in range(failed_at + 1, failed_at + 6):  # every later step says so, fast path or not
        _step(model, opt)
        res = mgr.step(later)
        assert res.failures >= 1 and res.last_error == mgr.failures[-1], (later, res)
    failures = mgr.close()
    assert failures
    assert not list(tiny_fs.rglob("*.tmp.*")), "a failed save left temporary files behind"
    # The newest committed checkpoint restores; step 1 at worst, intact.
    fresh = _model()
    with sc.CheckpointManager(tiny_fs) as again:
        again.register(model=fresh)
        step = again.restore()
    assert 1 <= step < failed_at
    if step == 1:
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def test_read_only_directory_keeps_training_and_earlier_checkpoints(bind_dir, tmp_path):
    # The blob directory (node-local disk) goes read-only; the journal lives in meta_dir.
    meta = tmp_path / "meta"
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mgr = sc.CheckpointManager(bind_dir, meta_dir=meta)
    mgr.register(model=model, optimizer=opt)
    _step(model, opt)
    assert mgr.save(1, blocking=True).wait() is not None
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _mount(["-o", "remount,bind,ro", str(bind_dir)])
    _step(model, opt)
    handle = mgr.save(2)
    assert handle.wait() is None
    assert "Read-only file system" in str(handle.error)
    _step(model, opt)  # training goes on
    failures = mgr.close()
    assert len(failures) == 1 and "step 2" in failures[0]
    # Restoring only reads: it works while the directory is still read-only.
    fresh = _model()
    with sc.CheckpointManager(bind_dir, meta_dir=meta) as again:
        again.register(model=fresh)
        assert again.restore() == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def _fill(where) -> None:
    """Fill the filesystem holding ``where`` to the last byte (a ballast file)."""
    import os

    fd = os.open(where / "ballast", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\1" * size)
            except OSError:
                continue
    finally:
        os.close(fd)


def test_a_disk_that_fills_and_frees_mid_run_never_raises_into_the_loop(tmp_path):
    """A 24 MB tmpfs filled at step 10 and freed at step 26, a save every 2 steps, and the trace's
    folder a read-only mount from step 14 to 20: no exception reaches the training loop (not from
    the saves, not from the trace's flush), each failure is recorded, and saving, the trace and
    the journal work again once they can."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)])
    try:
        model = _model()
        opt = torch.optim.AdamW(model.parameters())
        store = mnt / "store"
        mgr = sc.CheckpointManager(store, keep_last=2, every_steps=2, eval_every=1)
        mgr.register(model=model, optimizer=opt)
        raised, committed_after = [], []
        for step in range(1, 41):
            if step == 10:
                _fill(mnt)
            if step == 14:
                traces = store / "traces"
                _mount(["--bind", str(traces), str(traces)])
                _mount(["-o", "remount,ro,bind", str(traces)])
            if step == 20:
                subprocess.run(["umount", str(store / "traces")], check=True)
            if step == 26:
                (mnt / "ballast").unlink()
            try:
                _step(model, opt)
                res = mgr.step(step, loss=float(step))
                if res.handle is not None and res.handle.wait() is not None and step > 26:
                    committed_after.append(step)
            except Exception as err:  # what the issue saw: OSError ENOSPC out of mgr.step()
                raised.append((step, repr(err)))
        failures = mgr.close()
        from smartckpt_cli.store.directory import open_store

        _, journal = open_store(store).journal.read_events()
        (trace,) = (store / "traces").glob("*.csv")
        traced = [int(line.split(",")[0]) for line in trace.read_text().splitlines()[1:]]
    finally:
        subprocess.run(["umount", "-l", str(store / "traces")], check=False, capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    assert raised == []
    assert failures and all("No space left on device" in f or "Read-only" in f for f in failures), failures
    assert committed_after, "no save committed once the disk had room again"
    # Reported where it shows, once there was room to write it: every failed save, the trace's
    # failure and its recovery; the trace kept the lines of the full period in memory.
    failed = [e for e in journal if e["event"] == "save_failed"]
    assert len(failed) == len(failures) and any("No space left" in e["cause"] for e in failed)
    assert [e["event"] for e in journal if e.get("what") == "trace"] == ["io_error", "io_ok"]
    assert set(range(12, 26)) <= set(traced), traced
    trace_error = next(e for e in journal if e["event"] == "io_error")
    assert "Read-only file system" in trace_error["error"], trace_error


class _Flaky:
    """A registered object whose ``state_dict()`` raises (a bug in user code, a codec error...)
    while ``broken`` is set: a failure that is neither an OSError nor smartckpt's own."""

    def __init__(self) -> None:
        self.broken = False
        self.value = 0

    def state_dict(self) -> dict:
        if self.broken:
            raise TypeError("state_dict of a user object raised")
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_a_failing_background_save_of_any_kind_is_recorded_never_raised(tmp_path, caplog):
    import logging

    from smartckpt_cli.store.directory import open_store

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    flaky = _Flaky()
    mgr = sc.CheckpointManager(tmp_path / "store", keep_last=3, every_steps=2)
    mgr.register(model=model, optimizer=opt, stats=flaky)
    committed = []
    with caplog.at_level(logging.DEBUG, logger="smartckpt_cli.engine.saving"):
        for step in range(1, 21):
            flaky.broken = 6 <= step < 14
            flaky.value = step
            _step(model, opt)
            res = mgr.step(step)  # must never raise, whatever the save does
            if res.handle is not None and res.handle.wait() is not None:
                committed.append(step)
    failures = mgr.close()
    assert committed and min(committed) < 6 and max(committed) >= 14, committed
    assert len(failures) >= 3 and all("TypeError: state_dict of a user object raised" in f for f in failures)
    errors = [r for r in caplog.records if r.name.endswith("saving") and r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # once per distinct cause
    _, events = open_store(tmp_path / "store").journal.read_events()
    failed = [e for e in events if e["event"] == "save_failed"]
    assert len(failed) == len(failures) and failed[0]["cause"].startswith("TypeError: state_dict")
    assert [e["repeat"] for e in failed] == list(range(len(failed)))


def test_an_event_two_threads_journal_at_once_is_written_once(tmp_path):
    """The loop and the save thread may both journal an event (a failure, an I/O problem): the
    one that finds the other writing leaves its event pending, and the writer's next call
    writes it, once. Two real threads over a real journal; the first is held inside its append."""
    import threading

    from smartckpt_cli.engine.saverecord import EventBacklog
    from smartckpt_cli.store.directory import open_store

    store = open_store(tmp_path / "ck", create=True)
    store.ensure_journal()
    inside, go = threading.Event(), threading.Event()

    class Held:
        def append(self, event):
            inside.set()
            go.wait(10)
            return store.journal.append(event)

    backlog = EventBacklog()
    backlog.add({"event": "save_failed", "step": 1, "error": "first"})
    writer = threading.Thread(target=backlog.flush, args=(Held(),))
    writer.start()
    assert inside.wait(10)
    backlog.add({"event": "save_failed", "step": 3, "error": "x"})
    backlog.flush(store.journal)  # the other thread is writing: returns, writes nothing
    assert not store.journal.read().failures
    go.set()
    writer.join(10)
    assert [f["step"] for f in store.journal.read().failures] == [1] and backlog.pending() == 1
    backlog.flush(store.journal)
    backlog.flush(store.journal)
    assert [f["step"] for f in store.journal.read().failures] == [1, 3] and backlog.pending() == 0
