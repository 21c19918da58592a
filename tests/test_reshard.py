"""The pieces of an elastic resume that need no second process: shard geometry against
``torch.chunk``, reading only the chunks that hold some rows, the refusals, the RNG rule.
(tests/test_elastic.py runs the whole thing under torchrun.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.engine.reshard import derived_seed, load_resharded, sharded_entries
from smartckpt_cli.engine.restore import decode_entry, decode_rows
from smartckpt_cli.errors import StateMismatchError
from smartckpt_cli.state.shards import chunk_range, pieces, sharded_dim
from smartckpt_cli.store.checkpoints import candidates

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.mark.parametrize("length", [0, 1, 5, 7, 34, 64, 97])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunk_range_is_how_torch_chunk_splits(length, world):
    parts = torch.arange(length).chunk(world) if length else ()
    got = [chunk_range(length, world, r) for r in range(world)]
    expect = [(int(p[0]), int(p[-1]) + 1) for p in parts if p.numel()]
    assert [g for g in got if g[0] < g[1]] == expect
    assert sum(b - a for a, b in got) == length


@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (2, 3), (3, 2), (4, 3), (3, 8)])
def test_pieces_rebuild_every_new_shard_from_the_old_ones(old, new):
    length = 34
    rows = torch.arange(length)
    old_shards = [rows[slice(*chunk_range(length, old, q))] for q in range(old)]
    for r in range(new):
        lo, hi = chunk_range(length, new, r)
        out = torch.full((hi - lo,), -1)
        for p in pieces(length, old, new, r):
            out[p.dst_start : p.dst_start + p.src_stop - p.src_start] = old_shards[p.old_rank][
                p.src_start : p.src_stop
            ]
        assert torch.equal(out, rows[lo:hi])
        # only old ranks whose rows overlap are named
        assert all(
            max(lo, chunk_range(length, old, p.old_rank)[0])
            < min(hi, chunk_range(length, old, p.old_rank)[1])
            for p in pieces(length, old, new, r)
        )


def test_two_d_meshes_and_partial_are_refused_in_one_line():
    assert sharded_dim("model/w", ["S0"]) == 0 and sharded_dim("model/w", ["R"]) is None
    with pytest.raises(StateMismatchError, match=r"model/w: saved on a 2-D device mesh \(S0, S1\)"):
        sharded_dim("model/w", ["S0", "S1"])
    with pytest.raises(StateMismatchError, match="placement P cannot be restored"):
        sharded_dim("model/w", ["P"])


def _store_with(tmp_path: Path, tensor: torch.Tensor) -> tuple[sc.CheckpointManager, dict]:
    class Holder:
        def __init__(self) -> None:
            self.t = tensor

        def state_dict(self) -> dict:
            return {"t": self.t}

        def load_state_dict(self, sd: dict) -> None:
            self.t = sd["t"]

    mgr = sc.CheckpointManager(tmp_path / "ck", chunk_mb=1, keep_last=5)
    mgr.register(holder=Holder())
    mgr.save(1, blocking=True)
    mgr.close()
    rec = candidates(mgr.store.journal.read().records)[0]
    manifest = json.loads((tmp_path / "ck" / rec.manifest).read_text())
    return mgr, manifest


def test_rows_of_dimension_zero_read_only_the_chunks_that_hold_them(tmp_path):
    t = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(1))  # 8 MiB: 8 chunks of 1 MiB
    mgr, manifest = _store_with(tmp_path, t)
    entry = manifest["entries"]["holder/t"]
    assert len(entry["data"]["chunks"]) == 8
    whole, total = decode_entry(mgr.store.blobs, "holder/t", entry)
    assert torch.equal(whole, t)
    rows, nbytes = decode_rows(mgr.store.blobs, "holder/t", entry, 0, 300, 500)  # inside chunk 1
    assert torch.equal(rows, t[300:500])
    assert nbytes < total / 6, (nbytes, total)
    rows, nbytes = decode_rows(mgr.store.blobs, "holder/t", entry, 0, 200, 300)  # spans chunks 0 and 1
    assert torch.equal(rows, t[200:300]) and total / 6 < nbytes < total / 3
    cols, nbytes = decode_rows(mgr.store.blobs, "holder/t", entry, 1, 10, 20)  # another dim: whole
    assert torch.equal(cols, t[:, 10:20]) and nbytes == total


def test_a_damaged_chunk_among_the_rows_is_detected(tmp_path):
    t = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(2))
    mgr, manifest = _store_with(tmp_path, t)
    entry = manifest["entries"]["holder/t"]
    bid = entry["data"]["chunks"][1][0]
    path = tmp_path / "ck" / "blobs" / bid[:2] / bid
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="blob"):
        decode_rows(mgr.store.blobs, "holder/t", entry, 0, 300, 500)
    rows, _ = decode_rows(mgr.store.blobs, "holder/t", entry, 0, 0, 200)  # chunk 0 is sound
    assert torch.equal(rows, t[:200])


def test_a_single_process_checkpoint_read_for_a_new_rank_gets_derived_generators(tmp_path):
    """Rank 1 of 2 did not exist (the checkpoint is one process's): its generators are seeded
    from the checkpoint and its rank, the same every time; rank 0 keeps the saved ones."""
    torch.manual_seed(123)
    model = torch.nn.Linear(4, 3)
    mgr = sc.CheckpointManager(tmp_path / "ck")
    mgr.register(model=model)
    mgr.save(7, blocking=True)
    mgr.close()
    store = mgr.store
    rec = candidates(store.journal.read().records)[0]
    sid = store.journal.read().store_id
    keep, report0 = load_resharded(store.storage, store.blobs, rec, sid, 0, 2)
    new, report1 = load_resharded(store.storage, store.blobs, rec, sid, 1, 2)
    again, _ = load_resharded(store.storage, store.blobs, rec, sid, 1, 2)
    assert report0.rng == "kept" and report1.rng.startswith("seeded ")
    assert torch.equal(keep.tensors["model/weight"], model.weight.detach())
    assert torch.equal(new.tensors["model/weight"], model.weight.detach())  # replicated
    assert not torch.equal(new.tensors["rng/torch"], keep.tensors["rng/torch"])
    assert torch.equal(new.tensors["rng/torch"], again.tensors["rng/torch"])
    assert derived_seed(7, 1, b"x") != derived_seed(7, 2, b"x") != derived_seed(8, 1, b"x")
    assert "written by 1 rank(s), restored on 2" in report1.line()
    assert sharded_entries(keep.manifest) == {}
