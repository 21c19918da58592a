"""store/directory.py: opening a store, and its single-writer lock."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from smartckpt_cli.errors import NotAStoreError, StoreLockedError, StoreNotFoundError
from smartckpt_cli.store.directory import WRITER_LOCK, WriterLock, open_store

# A child that takes the writer lock of argv[1], says so, and sleeps until it is killed.
HOLDER = """
import sys, time
from pathlib import Path
from smartckpt_cli.store.directory import WriterLock
lock = WriterLock(Path(sys.argv[1]))
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_second_lock_on_one_store_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = WriterLock(tmp_path)
    first.acquire()
    try:
        assert first.held
        assert (tmp_path / WRITER_LOCK).read_text().startswith(f"pid {os.getpid()} on ")
        second = WriterLock(tmp_path, tmp_path / "ckpt")
        with pytest.raises(StoreLockedError, match=f"ckpt is already being written by pid {os.getpid()}"):
            second.acquire()
        assert not second.held
    finally:
        first.release()
    assert not first.held


def test_released_lock_can_be_taken_again(tmp_path: Path) -> None:
    with WriterLock(tmp_path) as a:
        assert a.held
    assert not a.held
    b = WriterLock(tmp_path)
    b.acquire()
    b.acquire()  # taking a held lock again is a no-op, not a self-refusal
    b.release()
    b.release()  # releasing twice is harmless
    with WriterLock(tmp_path):
        pass


def test_lock_of_a_live_process_is_refused_and_of_a_killed_one_is_free(
    tmp_path: Path, child_env: dict[str, str], python: str
) -> None:
    child = subprocess.Popen(
        [python, "-c", HOLDER, str(tmp_path)], env=child_env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockedError, match=f"pid {child.pid} on "):
            WriterLock(tmp_path).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    # The holder died without releasing anything: the kernel dropped its flock, no stale lock.
    deadline = time.monotonic() + 5
    lock = WriterLock(tmp_path)
    while True:
        try:
            lock.acquire()
            break
        except StoreLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert (tmp_path / WRITER_LOCK).read_text().startswith(f"pid {os.getpid()} ")
    lock.release()


def test_store_writer_lock_covers_meta_dir_and_names_the_store(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", tmp_path / "meta", create=True)
    with store.writer_lock():
        assert (tmp_path / "meta" / WRITER_LOCK).exists()
        assert not (tmp_path / "data" / WRITER_LOCK).exists()
        with pytest.raises(StoreLockedError, match=str(tmp_path / "data")):
            store.writer_lock().acquire()


def test_open_store_without_create_refuses_what_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError):
        open_store(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotAStoreError, match="is not a directory"):
        open_store(tmp_path / "file")
    with pytest.raises(NotAStoreError, match="no journal"):
        open_store(tmp_path)
