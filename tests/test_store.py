"""smartckpt_cli/store/blobs.py: the content-addressed blob store (BlobStore) on a real LocalStorage.

A blob's name is the xxh3-128 of its bytes, it lives at ``blobs/<first two hex>/<name>``, it is
written once, and verifying it is re-hashing it."""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash

from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.storage.local import LocalStorage


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(LocalStorage(tmp_path))


def _put(blobs: BlobStore, data: bytes | list[bytes]) -> str:
    bid, pending = blobs.begin(data)
    assert pending is not None
    pending.finish()
    return bid


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_blob_is_named_by_its_hash_and_fans_out_by_two_hex_digits(blobs: BlobStore, tmp_path: Path) -> None:
    data = b"weights " * 1000
    bid = _put(blobs, data)
    assert bid == xxhash.xxh3_128_hexdigest(data)
    assert BlobStore.rel(bid) == f"blobs/{bid[:2]}/{bid}"
    assert _files(tmp_path) == [f"blobs/{bid[:2]}/{bid}"]  # no temporary file left
    assert (tmp_path / "blobs" / bid[:2] / bid).read_bytes() == data
    assert blobs.has(bid) and bytes(blobs.get(bid)) == data and blobs.size(bid) == len(data)
    assert list(blobs.all_ids()) == [bid]


def test_writing_existing_content_is_skipped(blobs: BlobStore, tmp_path: Path) -> None:
    bid = _put(blobs, b"frozen embedding")
    before = (tmp_path / BlobStore.rel(bid)).stat()
    assert blobs.begin(b"frozen embedding") == (bid, None)
    after = (tmp_path / BlobStore.rel(bid)).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert list(blobs.leftovers()) == []


def test_pieces_and_joined_bytes_give_the_same_blob(blobs: BlobStore, tmp_path: Path) -> None:
    pieces = [b"\x03header", memoryview(b"plane one" * 100), bytearray(b"plane two")]
    joined = b"".join(bytes(p) for p in pieces)
    bid = _put(blobs, pieces)
    assert bid == xxhash.xxh3_128_hexdigest(joined)
    assert (tmp_path / BlobStore.rel(bid)).read_bytes() == joined
    assert blobs.begin(joined) == (bid, None)


def test_verify_finds_a_flipped_byte_and_a_missing_blob(blobs: BlobStore, tmp_path: Path) -> None:
    bid = _put(blobs, bytes(range(256)) * 16)
    assert blobs.verify(bid) is None
    path = tmp_path / BlobStore.rel(bid)
    raw = bytearray(path.read_bytes())
    raw[1000] ^= 0x01
    path.write_bytes(raw)
    assert blobs.verify(bid) == f"hash mismatch in blob {bid}"
    path.unlink()
    assert blobs.verify(bid) == f"missing blob {bid}"


def test_leftovers_of_an_aborted_write_are_listed_and_not_ids(blobs: BlobStore, tmp_path: Path) -> None:
    done = _put(blobs, b"committed")
    bid, pending = blobs.begin(b"never finished")  # the process dies before finish()
    assert pending is not None
    try:
        (left,) = blobs.leftovers()
        assert left.startswith(f"blobs/{bid[:2]}/{bid}.tmp.")
        assert (tmp_path / left).read_bytes() == b"never finished"
        assert list(blobs.all_ids()) == [done]
        assert not blobs.has(bid)
    finally:
        pending.abort()
    assert list(blobs.leftovers()) == []


def test_remove(blobs: BlobStore, tmp_path: Path) -> None:
    keep, gone = _put(blobs, b"keep"), _put(blobs, b"gone")
    blobs.remove(gone)
    assert not blobs.has(gone) and blobs.has(keep)
    assert list(blobs.all_ids()) == [keep]
    assert blobs.verify(gone) == f"missing blob {gone}"
    blobs.remove(gone)  # removing what is not there is not an error
    assert _files(tmp_path) == [BlobStore.rel(keep)]


def test_a_stray_file_beside_the_fan_out_folders_is_ignored(tmp_path):
    """A file nobody of ours wrote directly under blobs/ (a .DS_Store) must not stop listing,
    and so garbage collection."""
    blobs = BlobStore(LocalStorage(tmp_path))
    bid, pending = blobs.begin(b"x" * 100)
    assert pending is not None
    pending.finish()
    (tmp_path / "blobs" / ".DS_Store").write_bytes(b"\0")
    assert list(blobs.all_ids()) == [bid]
    assert list(blobs.leftovers()) == []
