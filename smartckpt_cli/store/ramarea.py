"""The RAM tier's format: each rank's newest snapshot in shared memory, beside the store. No torch.

``smartckpt run`` owns a folder in a tmpfs (``/dev/shm`` or ``ram_dir``),
``smartckpt-<run id>/``, made before the first attempt and removed when the run ends, so what is
in it outlives every training process of the run. Each rank has ``rank<r>/`` in it::

    slot0, slot1    the staging buffers of the training process, mapped shared: a snapshot's
                    copy of the state *is* the RAM tier's copy (no second copy)
    ram.json        the commit record: which slot holds the newest complete snapshot, of which
                    step, every entry's place in it and the xxh3-128 of every chunk

Double-buffered: a snapshot is copied into the slot the record does *not* name, hashed, and only
then does the record (written whole: tmp + rename) name it, so a complete, hashed snapshot always
exists while the next one is written; a process that dies half-way through a copy leaves the
record naming the previous slot. Whoever reads a slot (a restore, the flash persist of
``smartckpt run``) holds a shared ``flock`` on it, and the writer takes an exclusive one before
it copies into a slot (never waiting: a slot being read is skipped).

Slots are sized with ``posix_fallocate`` before they are mapped: a tmpfs without room refuses
then (one line, the tier stands down) instead of a SIGBUS at the first write into a page that
cannot be had. Everything read back is checked (:func:`read_record`): the slot's name, every
offset and length against the slot's size, dtypes, shapes; :func:`verify` re-hashes every chunk.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from smartckpt_cli.store import codec
from smartckpt_cli.store.names import (
    RAM_RECORD,
    check_blob_id,
    check_ram_slot,
    check_store_id,
    shown,
)

__all__ = [
    "ALIGN",
    "DEFAULT_DIR",
    "ENV_AREA",
    "ENV_BYTES",
    "FLASH_LOCK",
    "PAGE",
    "RAM_FORMAT",
    "RAM_VERSION",
    "Slot",
    "chunk_hashes",
    "default_budget",
    "drop_record",
    "flash_wait",
    "layout",
    "local_ranks",
    "read_record",
    "reading",
    "room",
    "verify",
    "write_record",
]

ENV_AREA = "SMARTCKPT_RAM_AREA"  # the run's RAM area (smartckpt run's handshake; unset: tier off)
ENV_BYTES = "SMARTCKPT_RAM_BYTES"  # the budget per rank smartckpt run worked out (bytes)
DEFAULT_DIR = "/dev/shm"
FLASH_LOCK = "flash.lock"  # in the area: held by smartckpt run while a flash persist writes
RAM_FORMAT = "smartckpt-ram"
RAM_VERSION = 1
ALIGN = 64  # every entry starts on a cache line (and on any dtype's alignment)
PAGE = mmap.PAGESIZE


def layout(sizes: list[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Pure: (offset of each key, slot size) for entries of ``sizes`` bytes, in that order."""
    offsets: dict[str, int] = {}
    pos = 0
    for key, nbytes in sizes:
        offsets[key] = pos
        pos += -(-max(nbytes, 1) // ALIGN) * ALIGN
    return offsets, max(pos, ALIGN)


def local_ranks() -> int:
    """The ranks on this node (``LOCAL_WORLD_SIZE``, as torchrun sets it); 1 when unset or not a
    positive number."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def default_budget(ranks: int | None = None) -> int:
    """Half the memory available now, shared by the node's ranks (:func:`local_ranks`)."""
    import psutil

    return int(psutil.virtual_memory().available * 0.5 / max(1, ranks or local_ranks()))


def flash_wait(area: str | os.PathLike[str]) -> None:
    """Until no flash persist of ``smartckpt run`` writes into the store (its ``flash.lock``,
    exclusive while it writes): a training process's commit comes after it, in step order."""
    path = Path(area) / FLASH_LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # none was ever started
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


def room(directory: str | os.PathLike[str]) -> int:
    """Bytes a process may still allocate in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class Slot:
    """One slot file, opened read-write; :meth:`resize` sizes and maps it (shared).

    ``posix_fallocate`` gives every page at once: where the tmpfs is full it raises ``OSError``
    (ENOSPC) there, before anything is mapped, instead of a SIGBUS in a later copy. Resize only
    under :meth:`try_lock`: a reader's mapping must never lose pages under it."""

    def __init__(self, path: Path, size: int = 0) -> None:
        self.path, self.size = path, 0
        self.map: mmap.mmap | None = None
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if size:
            try:
                self.resize(size)
            except BaseException:
                self.close()
                raise

    def resize(self, size: int) -> None:
        if os.fstat(self.fd).st_size > size:
            os.ftruncate(self.fd, size)
        os.posix_fallocate(self.fd, 0, size)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size

    def try_lock(self) -> bool:
        """Take the slot for writing (exclusive, never waiting); False while somebody reads it."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(OSError, ValueError, BufferError):
                self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


@contextlib.contextmanager
def reading(rank_dir: Path, slot: str) -> Iterator[memoryview]:
    """A slot mapped read-only under a shared ``flock`` (the writer skips it meanwhile)."""
    fd = os.open(rank_dir / check_ram_slot(slot, str(rank_dir)), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
        try:
            view = memoryview(m) if m is not None else memoryview(b"")
            try:
                yield view
            finally:
                view.release()
        finally:
            if m is not None:
                m.close()
    finally:
        os.close(fd)  # drops the lock


def chunk_hashes(view: memoryview, chunk_bytes: int) -> list[list[Any]]:
    """``[[length, xxh3-128], ...]`` of ``view`` cut every ``chunk_bytes`` (the writer's chunking)."""
    n = len(view)
    if n == 0:
        return [[0, codec.raw_hash(b"")]]
    return [
        [min(chunk_bytes, n - i), codec.raw_hash(view[i : i + chunk_bytes])] for i in range(0, n, chunk_bytes)
    ]


def write_record(rank_dir: Path, record: dict[str, Any]) -> None:
    """The commit point of a RAM snapshot: the record written whole (tmp + rename; a tmpfs needs
    no fsync, and outlives the process, not the machine)."""
    tmp = rank_dir / f".{RAM_RECORD}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"format": RAM_FORMAT, "version": RAM_VERSION, **record}))
        os.replace(tmp, rank_dir / RAM_RECORD)
    except BaseException:  # a full tmpfs: no half-written file left holding its memory
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def drop_record(rank_dir: Path) -> None:
    """The RAM snapshot withdrawn: its slot is about to be written again (one slot, no second
    to take turns with). Gone before the first byte changes, so a crash meanwhile leaves no
    record naming a torn slot: the restore goes to the disk."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(rank_dir / RAM_RECORD)


def _int(value: Any, where: str, field: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: {field} {shown(value)} is not an integer >= {low}")
    return value


def read_record(rank_dir: Path) -> dict[str, Any] | None:
    """The commit record, checked (module docstring); None when there is none yet. Raises
    ``ValueError`` (:class:`~smartckpt_cli.store.names.InvalidName` is one) naming the field for a record that is damaged or was
    not written by smartckpt."""
    where = str(rank_dir / RAM_RECORD)
    try:
        raw = (rank_dir / RAM_RECORD).read_bytes()
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        raise ValueError(f"{where} is not JSON") from None
    if not isinstance(rec, dict) or rec.get("format") != RAM_FORMAT:
        raise ValueError(f"{where} is not a RAM tier record")
    if rec.get("version") != RAM_VERSION:
        raise ValueError(f"{where}: version {shown(rec.get('version'))} is not supported")
    slot = check_ram_slot(rec.get("slot"), where)
    check_store_id(rec.get("store_id"), where)
    _int(rec.get("step"), where, "step")
    size = _int(rec.get("slot_size"), where, "slot_size", 1)
    try:
        actual = os.stat(rank_dir / slot).st_size
    except FileNotFoundError:
        raise ValueError(f"{where}: its {slot} is missing") from None
    if actual < size:
        raise ValueError(f"{where}: {slot} holds {actual} bytes, the record {size}")
    entries = rec.get("entries")
    if not isinstance(entries, dict) or not isinstance(rec.get("objects"), dict):
        raise ValueError(f"{where}: entries or objects is not a mapping")
    for key, e in entries.items():
        _check_entry(where, f"entry {shown(key)}", e, size)
    return rec


def _check_entry(where: str, name: str, e: Any, size: int) -> None:
    """One entry of a record: its dtype and shape, its place inside a slot of ``size`` bytes, and
    chunks that cover it exactly; else ``ValueError`` naming the field."""
    if not isinstance(e, dict) or not isinstance(e.get("tier"), str):
        raise ValueError(f"{where}: {name} is not an entry")
    try:
        item = codec.itemsize(e.get("dtype"))  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise ValueError(f"{where}: {name} dtype {shown(e.get('dtype'))} is unknown") from None
    shape = e.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"{where}: {name} shape {shown(shape)} is not a list of sizes")
    count = 1
    for n in shape:
        count *= n
    nbytes = _int(e.get("nbytes"), where, f"{name} nbytes")
    off = _int(e.get("offset"), where, f"{name} offset")
    if nbytes != count * item or off + nbytes > size:
        raise ValueError(f"{where}: {name} ({nbytes} bytes at {off}) does not fit its shape or slot")
    chunks = e.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ValueError(f"{where}: {name} chunks is not a list")
    total = 0
    for c in chunks:
        if not isinstance(c, list) or len(c) != 2:
            raise ValueError(f"{where}: {name} chunk {shown(c)} is not [length, hash]")
        total += _int(c[0], where, f"{name} chunk length")
        check_blob_id(c[1], where, f"{name} chunk hash")
    if total != nbytes:
        raise ValueError(f"{where}: {name} chunks cover {total} of {nbytes} bytes")


def verify(
    view: memoryview,
    rec: dict[str, Any],
    copy: Callable[[str, int, memoryview], None] | None = None,
    workers: int = 1,
) -> str | None:
    """None when every chunk of every entry hashes to what the record says; else the first
    failure, in words (the entry, the chunk, its place in the slot).

    ``copy(key, at, chunk)`` gets each chunk (its place in the entry, its bytes) on the thread
    that hashed it, right after (a restore copies out of the slot in the same pass: the chunk
    is read once); what it copied means nothing unless the whole returns None. ``workers``
    threads share the chunks: a restore's time is the page faults of the slot's mapping and of
    the fresh memory it fills, and the hash and the copy run without the GIL."""
    tasks: list[tuple[str, int, int, int, str, int]] = []
    for key, e in rec["entries"].items():
        pos, at = int(e["offset"]), 0
        for n, (length, want) in enumerate(e["chunks"]):
            tasks.append((key, n, pos, at, want, length))
            pos, at = pos + length, at + length

    def one(task: tuple[str, int, int, int, str, int]) -> str | None:
        key, n, pos, at, want, length = task
        chunk = view[pos : pos + length]
        if codec.raw_hash(chunk) != want:
            return f"entry {key} chunk {n} (bytes {pos}..{pos + length} of {rec['slot']}) fails its hash"
        if copy is not None:
            copy(key, at, chunk)
        return None

    if workers <= 1 or len(tasks) <= 1:
        return next((bad for bad in map(one, tasks) if bad is not None), None)
    with ThreadPoolExecutor(min(workers, len(tasks)), thread_name_prefix="smartckpt-ram-read") as pool:
        return next((bad for bad in pool.map(one, tasks) if bad is not None), None)
