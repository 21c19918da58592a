"""Damage on disk is detected by hash and skipped, never loaded.

A module fixture writes a real store with two checkpoints (steps 1 and 2; chunk_mb=1, so the big
layer and its moments span several chunk blobs; a frozen layer shares its blobs between both).
Each test damages a private copy of it: one flipped byte in a blob or in a manifest, a missing
blob, a torn journal line, a corrupt optimizer moment, and checks what a restore loads.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from smartckpt_cli import CheckpointManager, NoCheckpointError
from smartckpt_cli.cli.app import app
from smartckpt_cli.ops.verify import verify_store
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.store.journal import Journal, decode_line, encode_line
from smartckpt_cli.store.storage.local import LocalStorage
from tests.conftest import clean_env

pytestmark = pytest.mark.usefixtures("isolated")

LR = {1: 1e-3, 2: 5e-4}  # lr differs per checkpoint: proves which param_groups were loaded

# Every state entry whose content changes between step 1 and step 2. The frozen layer
# (model/0.*) and NumPy's RNG do not change: their blobs are shared by both checkpoints.
# test_every_unshared_blob_is_covered checks this list against the manifests.
TRAINABLE = ["model/2.weight", "model/2.bias", "model/4.weight", "model/4.bias"]
CHANGING_KEYS = [
    *TRAINABLE,
    *(f"optimizer/state/{i}/{name}" for i in range(4) for name in ("exp_avg", "exp_avg_sq", "step")),
    "rng/torch",
]


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 128),  # frozen
        torch.nn.ReLU(),
        torch.nn.Linear(128, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1100),  # 1.07 MiB of weights: two chunks at chunk_mb=1
    )
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR[1])
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@dataclass
class Pristine:
    path: Path
    refs: dict[int, dict[str, Any]]  # step -> {"model", "optimizer", "torch_rng"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    path = tmp_path_factory.mktemp("corruption") / "store"
    refs: dict[int, dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as mp:
        clean_env(mp, path.parent)
        torch.manual_seed(0)
        model, opt = _build()
        with CheckpointManager(path, keep_last=5, chunk_mb=1) as mgr:
            mgr.register(model=model, optimizer=opt)
            for step in (1, 2):
                for group in opt.param_groups:
                    group["lr"] = LR[step]
                _train_step(model, opt)
                refs[step] = {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optimizer": copy.deepcopy(opt.state_dict()),
                    "torch_rng": torch.get_rng_state(),
                }
                assert mgr.save(step, blocking=True).wait() is not None, mgr.failures
    return Pristine(path, refs)


@pytest.fixture
def store(pristine: Pristine, tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(pristine.path, dst)
    return dst


# ---------------------------------------------------------------------------- helpers


def _records(store: Path):
    return Journal(LocalStorage(store), store).read().records


def _manifest(store: Path, step: int) -> dict[str, Any]:
    rec = next(r for r in _records(store) if r.step == step)
    return json.loads((store / rec.manifest).read_bytes())


def _chunks(manifest: dict[str, Any], key: str) -> list[str]:
    entry = manifest["entries"][key]
    out = [c[0] for c in entry["data"]["chunks"]]
    if entry.get("patch"):
        out += [c[0] for c in entry["patch"]["chunks"]]
    return out


def _all_blobs(manifest: dict[str, Any]) -> set[str]:
    return {b for key in manifest["entries"] for b in _chunks(manifest, key)}


def _blob_path(store: Path, bid: str) -> Path:
    return store / "blobs" / bid[:2] / bid


def _flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int((len(data) - 1) * where)] ^= 0xFF
    path.write_bytes(data)


def _restore(store: Path, **settings: Any) -> tuple[int, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(999)  # a different init: whatever matches a reference was loaded
    model, opt = _build()
    with CheckpointManager(store, create=False, **settings) as mgr:
        mgr.register(model=model, optimizer=opt)
        step = mgr.restore()
    return step, model, opt


def _assert_model(model: torch.nn.Module, ref: dict[str, Any]) -> None:
    for key, want in ref["model"].items():
        assert torch.equal(model.state_dict()[key], want), key


def _assert_optimizer(opt: torch.optim.Optimizer, ref: dict[str, Any]) -> None:
    got, want = opt.state_dict(), ref["optimizer"]
    assert got["param_groups"] == want["param_groups"]
    assert set(got["state"]) == set(want["state"])
    for pid, st in want["state"].items():
        for name, t in st.items():
            assert torch.equal(got["state"][pid][name], t), (pid, name)


def _unshared_blobs(store: Path) -> set[str]:
    return _all_blobs(_manifest(store, 2)) - _all_blobs(_manifest(store, 1))


# ---------------------------------------------------------------------------- (a) flipped bytes


def test_fixture_store_is_sound(pristine: Pristine) -> None:
    results, problems = verify_store(open_store(pristine.path), all_checkpoints=True)
    assert [(r.step, r.ok) for r in results] == [(2, True), (1, True)] and problems == []
    m2 = _manifest(pristine.path, 2)
    assert len(_chunks(m2, "model/4.weight")) == 2  # chunk_mb=1 really splits the big tensor
    assert _all_blobs(m2) & _all_blobs(_manifest(pristine.path, 1)), "expected shared blobs"


def test_every_unshared_blob_is_covered(pristine: Pristine) -> None:
    m2 = _manifest(pristine.path, 2)
    unshared = _unshared_blobs(pristine.path)
    keys = {k for k in m2["entries"] if set(_chunks(m2, k)) & unshared}
    assert keys == set(CHANGING_KEYS)


@pytest.mark.parametrize("key", CHANGING_KEYS)
def test_flipped_byte_in_newest_blob_falls_back(
    key: str, store: Path, pristine: Pristine, caplog: pytest.LogCaptureFixture
) -> None:
    blobs = [b for b in _chunks(_manifest(store, 2), key) if b in _unshared_blobs(store)]
    assert blobs, f"{key} has no blob of its own in step 2"
    for n, bid in enumerate(blobs):
        path = _blob_path(store, bid)
        original = path.read_bytes()
        for where in ((0.5, 0.0, 1.0)[n % 3],):  # middle, first or last byte
            _flip_byte(path, where)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="smartckpt_cli.engine"):
                step, model, opt = _restore(store)
            assert step == 1, f"corrupt blob {bid} of {key} was not detected"
            assert any("step 2" in r.getMessage() and bid in r.getMessage() for r in caplog.records), [
                r.getMessage() for r in caplog.records
            ]
            _assert_model(model, pristine.refs[1])
            _assert_optimizer(opt, pristine.refs[1])
            assert torch.equal(torch.get_rng_state(), pristine.refs[1]["torch_rng"])
            path.write_bytes(original)
    step, model, _ = _restore(store)  # repaired: the newest one is back
    assert step == 2
    _assert_model(model, pristine.refs[2])


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_flipped_byte_in_newest_manifest_falls_back(
    where: float, store: Path, pristine: Pristine, caplog: pytest.LogCaptureFixture
) -> None:
    rec = next(r for r in _records(store) if r.step == 2)
    _flip_byte(store / rec.manifest, where)
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli.engine"):
        step, model, opt = _restore(store)
    assert step == 1
    assert any(f"step 2: manifest {rec.manifest}" in r.getMessage() for r in caplog.records)
    _assert_model(model, pristine.refs[1])
    _assert_optimizer(opt, pristine.refs[1])


def test_plausible_edit_of_newest_manifest_is_caught_by_its_hash(
    store: Path, pristine: Pristine, caplog: pytest.LogCaptureFixture
) -> None:
    """One changed digit that keeps the JSON valid and every blob reference intact (the learning
    rate): only the manifest hash in the journal can tell, and it must."""
    rec = next(r for r in _records(store) if r.step == 2)
    path = store / rec.manifest
    data = path.read_bytes()
    assert data.count(b'"lr":0.0005,') == 1
    path.write_bytes(data.replace(b'"lr":0.0005,', b'"lr":0.0006,'))
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli.engine"):
        step, model, opt = _restore(store)
    assert step == 1
    _assert_model(model, pristine.refs[1])
    assert any(f"manifest {rec.manifest} hash mismatch" in r.getMessage() for r in caplog.records)
    _assert_optimizer(opt, pristine.refs[1])


def test_missing_blob_falls_back(store: Path, pristine: Pristine) -> None:
    bid = _chunks(_manifest(store, 2), "model/4.weight")[1]
    _blob_path(store, bid).unlink()
    step, model, _ = _restore(store)
    assert step == 1
    _assert_model(model, pristine.refs[1])


def test_corrupt_shared_blob_leaves_nothing_restorable_and_objects_untouched(
    store: Path,
) -> None:
    shared = _all_blobs(_manifest(store, 2)) & _all_blobs(_manifest(store, 1))
    frozen = next(b for b in _chunks(_manifest(store, 2), "model/0.weight") if b in shared)
    _flip_byte(_blob_path(store, frozen))
    torch.manual_seed(999)
    model, opt = _build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(store, create=False) as mgr:
        mgr.register(model=model, optimizer=opt)
        with pytest.raises(NoCheckpointError, match=r"2 tried") as err:
            mgr.restore()
    assert frozen in str(err.value)
    for key, want in before.items():
        assert torch.equal(model.state_dict()[key], want), key
    assert opt.state_dict()["state"] == {}


def test_cli_verify_names_the_corrupt_blob(store: Path) -> None:
    bid = _chunks(_manifest(store, 2), "optimizer/state/2/exp_avg_sq")[0]
    _flip_byte(_blob_path(store, bid))
    result = CliRunner().invoke(app, ["verify", str(store), "--all"])
    assert result.exit_code == 1, result.output
    # rich wraps at 80 columns without a terminal: compare with the wrapping undone
    text = " ".join(result.output.split())
    assert re.search(rf"step 2 \(\w+\): CORRUPT: L2 entry \S+: hash mismatch in blob {bid}", text)
    assert re.search(r"step 1 \(\w+\): ok", text), text


# ---------------------------------------------------------------------------- (b) torn journal


def _append_torn_commit(store: Path) -> bytes:
    line = encode_line(
        {
            "event": "commit",
            "step": 3,
            "id": "0123456789ab",
            "manifest": "manifests/000000000003-0123456789ab.json",
            "manifest_hash": "0" * 32,
            "health": "ok",
        }
    )
    torn = line[: len(line) // 2]
    with open(store / "journal.jsonl", "ab") as f:
        f.write(torn)
    return torn


def test_torn_last_journal_line_is_skipped_with_a_warning(
    store: Path, pristine: Pristine, caplog: pytest.LogCaptureFixture
) -> None:
    torn = _append_torn_commit(store)
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli.store.journal"):
        step, model, opt = _restore(store)
    assert step == 2
    _assert_model(model, pristine.refs[2])
    _assert_optimizer(opt, pristine.refs[2])
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "smartckpt_cli.store.journal" and r.levelno == logging.WARNING
    ]
    assert warnings and all("torn last line" in w for w in warnings), warnings

    # Training goes on: the next saves commit on fresh lines that parse.
    torch.manual_seed(999)
    model, opt = _build()
    with CheckpointManager(store, create=False, chunk_mb=1) as mgr:
        mgr.register(model=model, optimizer=opt)
        assert mgr.restore() == 2
        for step in (3, 4):
            _train_step(model, opt)
            assert mgr.save(step, blocking=True).wait() is not None, mgr.failures
    want = {k: v.clone() for k, v in model.state_dict().items()}

    raw = (store / "journal.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.split(b"\n")[:-1]
    # The writer cut the torn tail off before appending: it never committed anything.
    assert torn not in raw
    assert all(decode_line(line) is not None for line in lines)
    assert [r.step for r in _records(store)] == [1, 2, 3, 4]

    step, model, _ = _restore(store)
    assert step == 4
    for key, t in want.items():
        assert torch.equal(model.state_dict()[key], t), key


def test_recovered_torn_line_does_not_fail_verify_forever(store: Path) -> None:
    _append_torn_commit(store)
    model, opt = _build()
    with CheckpointManager(store, create=False) as mgr:
        mgr.register(model=model, optimizer=opt)
        mgr.restore()
        assert mgr.save(3, blocking=True).wait() is not None
    result = CliRunner().invoke(app, ["verify", str(store)])
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------------------- (c) on_l2_corrupt


def _corrupt_l2_only_blob(store: Path) -> str:
    m1, m2 = _manifest(store, 1), _manifest(store, 2)
    l1_blobs = {b for k, e in m2["entries"].items() if e["tier"] != "L2" for b in _chunks(m2, k)}
    bid = _chunks(m2, "optimizer/state/2/exp_avg")[-1]
    assert m2["entries"]["optimizer/state/2/exp_avg"]["tier"] == "L2"
    assert bid not in l1_blobs and bid not in _all_blobs(m1)
    _flip_byte(_blob_path(store, bid))
    return bid


def test_corrupt_l2_falls_back_by_default(
    store: Path, pristine: Pristine, caplog: pytest.LogCaptureFixture
) -> None:
    bid = _corrupt_l2_only_blob(store)
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli.engine"):
        step, model, opt = _restore(store)
    assert step == 1
    assert any("L2" in r.getMessage() and bid in r.getMessage() for r in caplog.records)
    _assert_model(model, pristine.refs[1])
    _assert_optimizer(opt, pristine.refs[1])


def test_corrupt_l2_with_reset_keeps_newest_weights_and_restarts_moments(
    store: Path, pristine: Pristine, caplog: pytest.LogCaptureFixture
) -> None:
    _corrupt_l2_only_blob(store)
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli.engine"):
        step, model, opt = _restore(store, on_l2_corrupt="reset")
    assert step == 2
    _assert_model(model, pristine.refs[2])
    assert torch.equal(torch.get_rng_state(), pristine.refs[2]["torch_rng"])
    sd = opt.state_dict()
    assert sd["state"] == {}, "moments must be re-initialised, not half loaded"
    assert [g["lr"] for g in sd["param_groups"]] == [LR[2]]  # L1 hyperparameters of step 2
    assert any(
        r.levelno == logging.WARNING and "OPTIMIZER MOMENTS OF STEP 2 ARE CORRUPT" in r.getMessage()
        for r in caplog.records
    )
    _train_step(model, opt)  # the optimizer starts its moments over
    assert len(opt.state) == 4
    assert all(float(st["step"]) == 1.0 for st in opt.state.values())


def test_reset_does_not_forgive_a_corrupt_l1(store: Path, pristine: Pristine) -> None:
    bid = _chunks(_manifest(store, 2), "model/4.weight")[0]
    _flip_byte(_blob_path(store, bid))
    step, model, opt = _restore(store, on_l2_corrupt="reset")
    assert step == 1
    _assert_model(model, pristine.refs[1])
    _assert_optimizer(opt, pristine.refs[1])
