"""smartckpt_cli/engine/writer.py: the Persister turns a real snapshot into a committed checkpoint (blobs,
then the manifest, then the journal's commit line), shares identical content, chunks tensors and
marks non-finite weights. Real files: LocalStorage, BlobStore and Journal on tmp_path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from smartckpt_cli.engine.snapshot import Stager, take_snapshot
from smartckpt_cli.engine.writer import Persister
from smartckpt_cli.state.rng import RNGState
from smartckpt_cli.store import codec
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import JOURNAL, Journal
from smartckpt_cli.store.storage.local import LocalStorage


class Recording(LocalStorage):
    """The real local backend, noting each call and which files existed when it was made."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str, set[str]]] = []

    def _note(self, op: str, rel: str) -> None:
        files = {str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()}
        self.calls.append((op, rel, files))

    def write(self, rel: str, data: Any, *, sync_dir: bool = True) -> None:
        self._note("write", rel)
        super().write(rel, data, sync_dir=sync_dir)

    def append(self, rel: str, data: bytes) -> None:
        self._note("append", rel)
        super().append(rel, data)


class Store:
    """An empty store on ``root`` and a small model with AdamW after one step (moments set)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.storage = Recording(root)
        self.blobs = BlobStore(self.storage)
        self.journal = Journal(self.storage, root)
        self.store_id = self.journal.create()
        self.stager = Stager()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(64, 64)
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.model(torch.randn(4, 64)).sum().backward()
        self.opt.step()
        self.objects: dict[str, tuple[str, Any]] = {
            "model": ("module", self.model),
            "optimizer": ("optimizer", self.opt),
            "rng": ("rng", RNGState()),
        }

    def persister(self, *, level: int = 1, chunk_bytes: int = 1 << 20) -> Persister:
        args = (self.storage, self.blobs, self.journal, self.store_id)
        return Persister(*args, level=level, chunk_bytes=chunk_bytes, workers=2)

    def snapshot(self, step: int, objects: dict[str, tuple[str, Any]] | None = None) -> Any:
        return take_snapshot(
            objects or self.objects,
            stager=self.stager,
            step=step,
            reason="test",
            score=None,
            precision="exact",
            rules=(),
            meta={},
        )

    def manifest(self, rel: str) -> dict[str, Any]:
        return json.loads((self.root / rel).read_bytes())

    def last_event(self) -> dict[str, Any]:
        return json.loads((self.root / JOURNAL).read_bytes().splitlines()[-1])


def chunks(manifest: dict[str, Any]) -> list[list[Any]]:
    return [c for e in manifest["entries"].values() for c in e["data"]["chunks"]]


@pytest.fixture
def store(tmp_path: Path, isolated: None) -> Store:
    return Store(tmp_path)


def test_commit_line_comes_last_and_names_the_manifest_by_hash(store: Store) -> None:
    p = store.persister()
    info = p.persist(store.snapshot(1))
    p.close()
    manifest_bytes = (store.root / info.manifest).read_bytes()
    event = store.last_event()
    assert event["event"] == "commit"
    assert (event["step"], event["id"], event["manifest"]) == (1, info.id, info.manifest)
    assert event["manifest_hash"] == codec.blob_id(manifest_bytes)
    (record,) = store.journal.read().records
    assert (record.step, record.manifest, record.health) == (1, info.manifest, "ok")

    # Order: the manifest is written once every blob has its final name; the journal line after it.
    ops = [(op, rel) for op, rel, _ in store.storage.calls[1:]]  # [0]: the journal's init line
    assert ops == [("write", info.manifest), ("append", JOURNAL)]
    blob_files = {BlobStore.rel(c[0]) for c in chunks(store.manifest(info.manifest))}
    _, _, at_manifest = store.storage.calls[1]
    assert blob_files <= at_manifest and not [f for f in at_manifest if ".tmp." in f]
    _, _, at_commit = store.storage.calls[2]
    assert info.manifest in at_commit


def test_every_blob_exists_rehashes_to_its_name_and_bytes_add_up(store: Store) -> None:
    p = store.persister()
    info = p.persist(store.snapshot(1))
    p.close()
    named = chunks(store.manifest(info.manifest))
    for bid, _codec, _raw_len, _raw_hash, enc_len in named:
        data = (store.root / BlobStore.rel(bid)).read_bytes()
        assert codec.blob_id(data) == bid and len(data) == enc_len
    assert set(store.blobs.all_ids()) == {c[0] for c in named}
    on_disk = sum(f.stat().st_size for f in (store.root / "blobs").rglob("*") if f.is_file())
    assert info.bytes_new == on_disk
    assert info.bytes_total == sum(c[4] for c in named)
    # Adam's two `step` counters hold the same 4 bytes: stored once, referenced twice.
    assert info.bytes_total - info.bytes_new == 4
    assert store.last_event()["bytes_new"] == info.bytes_new


def test_unchanged_state_writes_nothing_and_shares_every_blob(store: Store) -> None:
    p = store.persister()
    first = p.persist(store.snapshot(1))
    files = set((store.root / "blobs").rglob("*"))
    second = p.persist(store.snapshot(2))
    p.close()
    assert (second.bytes_new, second.bytes_total) == (0, first.bytes_total)
    assert set((store.root / "blobs").rglob("*")) == files
    a, b = store.manifest(first.manifest), store.manifest(second.manifest)
    assert {k: e["data"] for k, e in a["entries"].items()} == {k: e["data"] for k, e in b["entries"].items()}


def test_nonfinite_l1_weight_marks_the_checkpoint(store: Store) -> None:
    with torch.no_grad():
        store.model.weight[3, 5] = float("inf")
    p = store.persister()
    info = p.persist(store.snapshot(1))
    p.close()
    assert info.health == "nonfinite-weights"
    assert store.manifest(info.manifest)["health"] == "nonfinite-weights"
    assert store.last_event()["health"] == "nonfinite-weights"


def test_small_chunks_cover_each_tensor_exactly(store: Store) -> None:
    class State:
        def __init__(self) -> None:
            self.w = torch.arange(1002, dtype=torch.float32)  # 4008 bytes
            self.d = torch.arange(300, dtype=torch.float64)  # 2400 bytes

        def state_dict(self) -> dict[str, torch.Tensor]:
            return {"w": self.w, "d": self.d}

    state = State()
    p = store.persister(chunk_bytes=1002)  # cut at 1000: a whole number of 4- and 8-byte elements
    info = p.persist(store.snapshot(1, {"s": ("state", state)}))
    p.close()
    entries = store.manifest(info.manifest)["entries"]
    for key, t, lens in (("s/w", state.w, [1000] * 4 + [8]), ("s/d", state.d, [1000, 1000, 400])):
        raw = t.numpy().tobytes()
        got = entries[key]["data"]["chunks"]
        assert [c[2] for c in got] == lens
        pos = 0
        for bid, cod, raw_len, raw_hash, _ in got:
            assert cod == "raw" and raw_hash == codec.raw_hash(raw[pos : pos + raw_len])
            assert (store.root / BlobStore.rel(bid)).read_bytes() == raw[pos : pos + raw_len]
            pos += raw_len
        assert pos == len(raw)


def test_remember_shares_the_blobs_of_a_restored_manifest(store: Store) -> None:
    # Written raw (level -1); a resumed run compresses (level 1), so it would write new blobs
    # for the same content unless remember() seeds its index from the restored manifest.
    raw_writer = store.persister(level=-1)
    first = store.manifest(raw_writer.persist(store.snapshot(1)).manifest)
    raw_writer.close()
    assert {c[1] for c in chunks(first)} == {"raw"}

    fresh = store.persister(level=1)
    fresh_info = fresh.persist(store.snapshot(2))
    fresh.close()
    fresh_codecs = {c[1] for c in chunks(store.manifest(fresh_info.manifest))}
    assert fresh_info.bytes_new > 0 and "planes" in fresh_codecs

    resumed = store.persister(level=1)
    resumed.remember(first)
    info = resumed.persist(store.snapshot(3))
    resumed.close()
    assert info.bytes_new == 0
    assert chunks(store.manifest(info.manifest)) == chunks(first)


def test_a_nonfinite_moment_marks_the_checkpoint_unhealthy(tmp_path):
    """A NaN in an optimizer moment (L2) would turn the weights into NaN at the first step after
    a resume: the checkpoint is committed for inspection but not healthy."""
    from smartckpt_cli import CheckpointManager

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.state[model.weight]["exp_avg_sq"][3, 4] = float("nan")
    with CheckpointManager(tmp_path) as mgr:
        mgr.register(model=model, optimizer=opt)
        info = mgr.save(1, blocking=True).wait()
    assert info is not None and info.health == "nonfinite-moments"
