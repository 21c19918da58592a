"""Crash-state explorer: the states a power cut could leave, replayed from a recorded save.

The approach of ALICE and CrashMonkey, on our own storage layer. ``Recorder`` replaces the ``os``
module that ``smartckpt_cli.store.storage.local`` sees with a proxy that logs every file-system operation
under the store root: create, write (with its offset and bytes), fsync of a file, fsync of a
directory, rename, unlink. The real operations still happen, so the save completes normally.

``crash_states`` then walks every prefix of the log. For a prefix, what a crash leaves is:

* a file's content is durable up to its last fsync; later writes may be lost, cut short, or (for
  more than one pending write) kept out of order with a hole of zeros before them;
* a name (create, rename, unlink) in a directory is durable once that directory was fsynced after
  it; later name operations may each be kept or lost, independently (which covers reordering).

Per prefix it yields: everything kept (what the running process saw), only the durable part, each
pending name operation dropped alone and kept alone, each pending file content lost, cut in
half, cut at a seeded point (a short write) or missing only its final newline (a line written
whole but for its ``\n``), and a few seeded random mixtures. States are deduplicated by their full content.

Assumption, not explored: directories created by ``mkdir`` (``blobs/ab``) survive a crash; the
storage layer does not fsync their parent (ext4 and XFS commit a new directory with the fsync of
a file inside it, POSIX does not promise it).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["CrashState", "Op", "Recorder", "clear_files", "crash_states", "materialise", "read_tree"]


@dataclass(frozen=True)
class Op:
    kind: str  # create | write | fsync | fsync_dir | rename | unlink
    path: str  # relative to the store root ("" for the root directory)
    dst: str = ""  # rename target
    offset: int = 0
    data: bytes = b""
    inode: int = -1


@dataclass
class CrashState:
    prefix: int  # number of operations of the log that were issued before the crash
    variant: str
    files: dict[str, bytes]
    digest: str = ""


class _RecordingOS(ModuleType):
    """Stands in for ``os`` inside the storage module; logs what touches the store root."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__("os")
        self._rec = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, mode: int = 0o777, *a: Any, **kw: Any) -> int:
        rel = self._rec.rel(path)
        existed = os.path.exists(path)
        fd = os.open(path, flags, mode, *a, **kw)
        if rel is not None:
            self._rec.opened(fd, rel, flags, existed)
        return fd

    def write(self, fd: int, data: Any) -> int:
        info = self._rec.fds.get(fd)
        if info is None:
            return os.write(fd, data)
        pos = os.fstat(fd).st_size if info[2] else os.lseek(fd, 0, os.SEEK_CUR)
        n = os.write(fd, data)
        self._rec.log(
            Op("write", info[0], offset=pos, data=bytes(memoryview(data).cast("B")[:n]), inode=info[1])
        )
        return n

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        info = self._rec.fds.get(fd)
        if info is not None:
            self._rec.log(Op("fsync_dir" if info[1] < 0 else "fsync", info[0], inode=info[1]))

    def close(self, fd: int) -> None:
        self._rec.fds.pop(fd, None)
        os.close(fd)

    def replace(self, src: Any, dst: Any) -> None:
        os.replace(src, dst)
        rs, rd = self._rec.rel(src), self._rec.rel(dst)
        if rs is not None and rd is not None:
            self._rec.log(Op("rename", rs, dst=rd))

    def unlink(self, path: Any) -> None:
        os.unlink(path)
        rel = self._rec.rel(path)
        if rel is not None:
            self._rec.log(Op("unlink", rel))


class Recorder:
    """Logs the file-system operations the storage layer makes under ``root`` while active."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self.fds: dict[int, tuple[str, int, bool]] = {}  # fd -> (rel path, inode or -1 for a dir, append)
        self.inodes: dict[str, int] = {}  # rel path -> inode number in the model
        self._next = 0
        self._lock = threading.Lock()

    def rel(self, path: Any) -> str | None:
        full = os.path.realpath(os.fspath(path))
        if full == self.root:
            return ""
        if not full.startswith(self.root + os.sep):
            return None
        return full[len(self.root) + 1 :]

    def log(self, op: Op) -> None:
        with self._lock:
            if op.kind == "rename":
                self.inodes[op.dst] = self.inodes.pop(op.path)
            elif op.kind == "unlink":
                self.inodes.pop(op.path, None)
            self.ops.append(op)

    def opened(self, fd: int, rel: str, flags: int, existed: bool) -> None:
        if os.path.isdir(os.path.join(self.root, rel)):
            self.fds[fd] = (rel, -1, False)
            return
        with self._lock:
            if not existed or rel not in self.inodes:
                self._next += 1
                self.inodes[rel] = self._next
                if not existed:
                    self.ops.append(Op("create", rel, inode=self._next))
            inode = self.inodes[rel]
        self.fds[fd] = (rel, inode, bool(flags & os.O_APPEND))

    def start(self, initial: dict[str, bytes]) -> None:
        """Begin recording; ``initial`` is the (durable) content of the store at this moment."""
        import smartckpt_cli.store.storage.local as local

        self.initial = dict(initial)
        for rel in sorted(initial):
            self._next += 1
            self.inodes[rel] = self._next
        self.inodes_initial = dict(self.inodes)
        self._saved_os = local.os
        local.os = _RecordingOS(self)  # type: ignore[assignment]

    def stop(self) -> None:
        import smartckpt_cli.store.storage.local as local

        local.os = self._saved_os


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def materialise(files: dict[str, bytes], root: Path) -> None:
    """Write ``files`` under ``root``, which holds no files (directories may remain from the
    previous state: mkdir and rmdir are what is slow here, and empty directories change nothing
    for a restore)."""
    made: set[str] = set()
    for rel, data in files.items():
        parent = os.path.dirname(rel)
        if parent not in made:
            (root / parent).mkdir(parents=True, exist_ok=True)
            made.add(parent)
        with open(root / rel, "wb") as f:
            f.write(data)


def clear_files(root: Path) -> None:
    """Remove every file under ``root`` and keep the directories, for the next ``materialise``."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            os.unlink(os.path.join(dirpath, name))


@dataclass
class _Model:
    """The file system after a prefix of the log, with what of it is durable."""

    initial: dict[str, bytes]
    inode_of_initial: dict[str, int]
    name_ops: list[tuple[int, Op]] = field(default_factory=list)  # (index, op) create/rename/unlink
    dir_synced: dict[str, int] = field(default_factory=dict)  # dir -> index of its last fsync
    writes: dict[int, list[tuple[int, Op]]] = field(default_factory=dict)  # inode -> writes
    file_synced: dict[int, int] = field(default_factory=dict)  # inode -> index of its last fsync


def _dir(rel: str) -> str:
    return os.path.dirname(rel)


def _build_model(ops: list[Op], prefix: int, initial: dict[str, bytes], inode_of: dict[str, int]) -> _Model:
    m = _Model(initial, inode_of)
    inodes = dict(inode_of)
    for i, op in enumerate(ops[:prefix]):
        if op.kind in ("create", "rename", "unlink"):
            if op.kind == "rename":
                op = Op("rename", op.path, dst=op.dst, inode=inodes.pop(op.path, -1))
                inodes[op.dst] = op.inode
            elif op.kind == "create":
                inodes[op.path] = op.inode
            else:
                op = Op("unlink", op.path, inode=inodes.pop(op.path, -1))
            m.name_ops.append((i, op))
        elif op.kind == "write":
            m.writes.setdefault(op.inode, []).append((i, op))
        elif op.kind == "fsync":
            m.file_synced[op.inode] = i
        elif op.kind == "fsync_dir":
            m.dir_synced[op.path] = i
    return m


def _name_durable(m: _Model, i: int, op: Op) -> bool:
    dirs = {_dir(op.path)} | ({_dir(op.dst)} if op.kind == "rename" else set())
    return all(m.dir_synced.get(d, -1) > i for d in dirs)


def _content(m: _Model, inode: int, base: bytes, mode: str, rng: random.Random) -> bytes:
    """The inode's bytes after a crash: durable writes, then pending ones as ``mode`` says."""
    data = bytearray(base)
    synced = m.file_synced.get(inode, -1)
    pending = []
    for i, w in m.writes.get(inode, []):
        if i < synced:
            _apply(data, w.offset, w.data)
        else:
            pending.append(w)
    if mode == "durable" or not pending:
        return bytes(data)
    if mode == "full":
        for w in pending:
            _apply(data, w.offset, w.data)
    elif mode == "half":  # the pending bytes cut in the middle
        full = bytearray(data)
        for w in pending:
            _apply(full, w.offset, w.data)
        cut = len(data) + (len(full) - len(data)) // 2
        data = full[:cut]
    elif mode in ("no-newline", "short"):
        # What a short write leaves (a full disk, NFS, FUSE): the pending bytes applied, then cut
        # just before the final newline, or at a seeded point anywhere in them.
        full = bytearray(data)
        for w in pending:
            _apply(full, w.offset, w.data)
        if mode == "no-newline":
            cut = len(full) - 1 if full.endswith(b"\n") else len(full)
        else:
            cut = len(data) + rng.randrange(max(1, len(full) - len(data)))
        data = full[:cut]
    elif mode == "random":  # a random subset of pending writes, each maybe cut short; holes are zeros
        for w in pending:
            r = rng.random()
            if r < 0.35:
                continue
            chunk = w.data if r < 0.7 else w.data[: rng.randrange(len(w.data) + 1)]
            _apply(data, w.offset, chunk)
    return bytes(data)


def _apply(data: bytearray, offset: int, chunk: bytes) -> None:
    if len(data) < offset:
        data.extend(b"\0" * (offset - len(data)))
    data[offset : offset + len(chunk)] = chunk


def _state(
    m: _Model, keep: set[int], modes: dict[int, str], rng: random.Random, default_mode: str
) -> dict[str, bytes]:
    names = dict(m.inode_of_initial)
    for i, op in m.name_ops:
        if not (_name_durable(m, i, op) or i in keep):
            continue
        if op.kind == "create":
            names[op.path] = op.inode
        elif op.kind == "rename":
            names.pop(op.path, None)
            if op.inode >= 0:
                names[op.dst] = op.inode
        else:
            names.pop(op.path, None)
    base_of = {m.inode_of_initial[p]: m.initial[p] for p in m.initial}
    return {
        path: _content(m, ino, base_of.get(ino, b""), modes.get(ino, default_mode), rng)
        for path, ino in sorted(names.items())
    }


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for path, data in sorted(files.items()):
        h.update(path.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def crash_states(
    ops: list[Op],
    initial: dict[str, bytes],
    inode_of: dict[str, int],
    *,
    random_per_prefix: int = 3,
    seed: int = 0,
) -> Iterator[CrashState]:
    """Every distinct crash state of every prefix of ``ops`` (see the module docstring)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    for prefix in range(len(ops) + 1):
        m = _build_model(ops, prefix, initial, inode_of)
        pending_names = [i for i, op in m.name_ops if not _name_durable(m, i, op)]
        all_pending = set(pending_names)
        pending_inodes = sorted(
            ino for ino, ws in m.writes.items() if any(i > m.file_synced.get(ino, -1) for i, _ in ws)
        )
        variants: list[tuple[str, set[int], dict[int, str], str]] = [
            ("as-seen", all_pending, {}, "full"),
            ("durable-only", set(), {}, "durable"),
        ]
        for i in pending_names:
            variants.append((f"drop-name-{i}", all_pending - {i}, {}, "full"))
            variants.append((f"only-name-{i}", {i}, {}, "full"))
        for ino in pending_inodes:
            variants.append((f"lose-data-{ino}", all_pending, {ino: "durable"}, "full"))
            variants.append((f"half-data-{ino}", all_pending, {ino: "half"}, "full"))
            variants.append((f"no-newline-{ino}", all_pending, {ino: "no-newline"}, "full"))
            variants.append((f"short-write-{ino}", all_pending, {ino: "short"}, "full"))
        for r in range(random_per_prefix):
            keep = {i for i in pending_names if rng.random() < 0.5}
            variants.append((f"random-{r}", keep, {}, "random"))
        for name, keep, modes, default in variants:
            files = _state(m, keep, modes, rng, default)
            digest = _digest(files)
            if digest in seen:
                continue
            seen.add(digest)
            yield CrashState(prefix, name, files, digest)
