"""Crash-state explorer over real saves (tests/faults/explorer.py; figures in tests/faults/README.md).

A store holds step 1 (durable, the state before recording). Two more saves (steps 2 and 3) are
recorded at the file-system level; every crash state of that log is rebuilt in a temporary
directory and restored with a fresh CheckpointManager. The restore must load, bit-exactly, the
newest checkpoint whose commit line is whole in the journal left by the crash (whenever the commit
was durable, it is there), and never fail. A planted bug in the commit order must be caught.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

import smartckpt_cli.store.storage.local as local
from smartckpt_cli import CheckpointManager
from smartckpt_cli.engine.restore import candidates, load_checkpoint
from smartckpt_cli.errors import CheckpointCorrupt
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.store.storage.local import LocalStorage, PendingWrite
from tests.faults.explorer import Recorder, clear_files, crash_states, materialise, read_tree

# Every crash or media fault on a real store, in a loop: end-to-end, out of the inner loop.
pytestmark = [pytest.mark.usefixtures("isolated"), pytest.mark.slow]

FULL_EVERY = 10  # one crash state in ten is restored through CheckpointManager itself


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors, keyed as the manifest keys them."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for name, val in st.items():
            if isinstance(val, torch.Tensor):
                out[f"optimizer/state/{i}/{name}"] = val.detach().clone()
    return out


def _same(now: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str | None:
    if now.keys() != ref.keys():
        return f"state keys differ: {sorted(now.keys() ^ ref.keys())[:3]}"
    for key, val in ref.items():
        a, b = now[key].contiguous(), val.contiguous()
        if a.dtype != b.dtype or a.numpy().tobytes() != b.numpy().tobytes():
            return f"{key} differs from what was saved"
    return None


def _record(tmp: Path, plant: bool = False) -> tuple[Recorder, dict[int, dict[str, torch.Tensor]]]:
    store = tmp / "store"
    torch.manual_seed(0)
    model, opt = _build()
    refs: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(store, keep_last=10) as mgr:
        mgr.register(model=model, optimizer=opt)
        _train(model, opt)
        mgr.save(1, blocking=True)
        refs[1] = _flat(model, opt)
        rec = Recorder(store)
        rec.start(read_tree(store))
        try:
            with pytest.MonkeyPatch.context() as mp:
                if plant:
                    _plant_commit_before_durable(mp)
                for step in (2, 3):
                    _train(model, opt)
                    mgr.save(step, blocking=True)
                    refs[step] = _flat(model, opt)
        finally:
            rec.stop()
    return rec, refs


def _plant_commit_before_durable(mp: pytest.MonkeyPatch) -> None:
    """The bug: blobs and the manifest are renamed into place without fsync of their content or
    of their directory, so the journal commit line is durable before what it points to."""

    def finish(self: PendingWrite) -> None:
        local.os.close(self.fd)  # through the module's os, so the recorder sees it
        self.fd = -1
        local.os.replace(self.tmp, self.final)

    mp.setattr(PendingWrite, "finish", finish)
    mp.setattr(LocalStorage, "sync_dirs", lambda self, dirs: None)


def _commit_steps(journal: bytes, rec: Recorder) -> list[int]:
    """Steps whose commit line is whole in this journal (by the recorded line bytes)."""
    lines = set(journal.split(b"\n")[:-1]) if journal else set()
    steps = []
    for op in rec.ops:
        if op.kind == "write" and op.path.endswith("journal.jsonl") and b'"event":"commit"' in op.data:
            line = op.data.rstrip(b"\n")
            if line in lines:
                steps.append(int(json.loads(line)["step"]))
    return steps


def _check(
    files: dict[str, bytes],
    where: Path,
    rec: Recorder,
    refs: dict[int, dict[str, torch.Tensor]],
    *,
    full: bool,
) -> str | None:
    """None when the restore is right, else what went wrong. ``full``: through CheckpointManager
    .restore() into fresh objects; otherwise the same selection and verification it makes
    (journal, candidates, load_checkpoint), without building a manager (ten times faster)."""
    expected = max([1, *_commit_steps(files.get("journal.jsonl", b""), rec)])
    materialise(files, where)
    try:
        if full:
            model, opt = _build()
            with CheckpointManager(where, keep_last=10) as mgr:
                mgr.register(model=model, optimizer=opt)
                got = mgr.restore()
            now = _flat(model, opt)
        else:
            got, now = _light_restore(where)
    except Exception as err:  # any failure of restore is a finding
        return f"restore failed: {type(err).__name__}: {err}"
    finally:
        clear_files(where)
    if got != expected:
        return f"restored step {got}, expected {expected}"
    problem = _same(now, refs[expected])
    return None if problem is None else f"step {got}: {problem}"


def _light_restore(where: Path) -> tuple[int, dict[str, torch.Tensor]]:
    store = open_store(where)
    state = store.journal.read()
    for record in candidates(state.records):
        try:
            loaded = load_checkpoint(store.storage, store.blobs, record, state.store_id, workers=1)
        except CheckpointCorrupt:
            continue
        keep = ("model/", "optimizer/state/")
        return record.step, {k: v for k, v in loaded.tensors.items() if k.startswith(keep)}
    return 0, {}


def _scratch(tmp: Path) -> Path:
    """Where crash states are rebuilt: a tmpfs when there is one (ten times faster), else tmp."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="smartckpt-crash-", dir=shm))
    return tmp / "crash"


def explore(tmp: Path, *, plant: bool = False, stop_after_wrong: int | None = None) -> dict[str, Any]:
    rec, refs = _record(tmp, plant=plant)
    inode_of = rec.inodes_initial
    counts: dict[str, Any] = {"ops": len(rec.ops), "states": 0, "full": 0, "wrong": 0}
    failures: list[str] = []
    scratch = _scratch(tmp)
    for n, state in enumerate(crash_states(rec.ops, rec.initial, inode_of, random_per_prefix=1)):
        counts["states"] += 1
        counts["full"] += n % FULL_EVERY == 0
        problem = _check(state.files, scratch, rec, refs, full=n % FULL_EVERY == 0)
        if problem is not None:
            counts["wrong"] += 1
            failures.append(f"prefix {state.prefix} ({state.variant}): {problem}")
        if stop_after_wrong is not None and counts["wrong"] >= stop_after_wrong:
            break
    shutil.rmtree(scratch, ignore_errors=True)
    counts["failures"] = failures[:5]
    return counts


def test_every_crash_state_restores_the_newest_durable_commit(tmp_path: Path) -> None:
    counts = explore(tmp_path)
    print(
        f"\ncrash-state explorer: {counts['ops']} operations recorded, {counts['states']} distinct crash "
        f"states, {counts['wrong']} wrong or failed restores"
    )
    assert counts["states"] >= 1000
    assert counts["wrong"] == 0, counts["failures"]


def test_explorer_catches_a_commit_before_the_data_is_durable(tmp_path: Path) -> None:
    counts = explore(tmp_path, plant=True, stop_after_wrong=3)
    print(
        f"\nplanted bug (commit before blobs/manifest durable): {counts['wrong']} of {counts['states']} "
        f"crash states restore wrongly; first: {counts['failures'][:1]}"
    )
    assert counts["wrong"] > 0
