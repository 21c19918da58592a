"""Media faults at scale: 1,200 seeded faults, each followed by a restore.

A pristine store holds four checkpoints of a tiny model (steps 1-4). Each case damages a copy of
it in one way: a bit flipped or the file cut at a random offset in a blob, a manifest or the
journal; a blob deleted; a manifest of another store copied over one of ours. The restore must
load, bit-exactly, the newest checkpoint none of whose files (commit line, manifest, blobs) was
touched, or refuse cleanly (NoCheckpointError / JournalError) when none is left, or start at 0
when the journal was cut before its first commit line. Never a corrupt
load, never another exception.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from smartckpt_cli import CheckpointManager
from smartckpt_cli.engine.restore import candidates, load_checkpoint
from smartckpt_cli.errors import CheckpointCorrupt, JournalError, NoCheckpointError
from smartckpt_cli.store.directory import open_store
from tests.faults.explorer import clear_files, materialise, read_tree

# Every crash or media fault on a real store, in a loop: end-to-end, out of the inner loop.
pytestmark = [pytest.mark.usefixtures("isolated"), pytest.mark.slow]

CASES = 1200
FULL_EVERY = 10  # one case in ten restores through CheckpointManager itself
STEPS = (1, 2, 3, 4)
KINDS = ("flip", "truncate", "delete-blob", "foreign-manifest")


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for name, val in st.items():
            if isinstance(val, torch.Tensor):
                out[f"optimizer/state/{i}/{name}"] = val.detach().clone()
    return out


def _make_store(path: Path, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model, opt = _build()
    refs = {}
    with CheckpointManager(path, keep_last=10) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in STEPS:
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, blocking=True)
            refs[step] = _flat(model, opt)
    return refs


def _files_of(tree: dict[str, bytes]) -> dict[int, set[str]]:
    """Per step, the files its restore reads (manifest and every blob it names)."""
    out: dict[int, set[str]] = {}
    for rel, data in tree.items():
        if not rel.startswith("manifests/"):
            continue
        man = json.loads(data)
        files = {rel}
        for entry in man["entries"].values():
            for part in (entry["data"], entry.get("patch") or {"chunks": []}):
                files.update(f"blobs/{c[0][:2]}/{c[0]}" for c in part["chunks"])
        out[int(man["step"])] = files
    return out


def _line_spans(journal: bytes) -> list[tuple[int, int, dict[str, Any]]]:
    spans, pos = [], 0
    for line in journal.split(b"\n")[:-1]:
        spans.append((pos, pos + len(line) + 1, json.loads(line)))
        pos += len(line) + 1
    return spans


def _inject(
    tree: dict[str, bytes],
    foreign: dict[str, bytes],
    files_of: dict[int, set[str]],
    rng: random.Random,
    kind: str,
) -> tuple[dict[str, bytes], str, set[int] | None]:
    """Damage a copy of ``tree``. Returns it, a description, and the steps damaged (None: the
    journal's init line was hit, so a clean refusal is the right answer too)."""
    tree = dict(tree)
    blobs = sorted(p for p in tree if p.startswith("blobs/"))
    manifests = sorted(p for p in tree if p.startswith("manifests/"))
    if kind == "delete-blob":
        victim = rng.choice(blobs)
        del tree[victim]
        return tree, f"deleted {victim}", {s for s, f in files_of.items() if victim in f}
    if kind == "foreign-manifest":
        victim = rng.choice(manifests)
        tree[victim] = foreign[rng.choice(sorted(p for p in foreign if p.startswith("manifests/")))]
        return tree, f"foreign manifest over {victim}", {s for s, f in files_of.items() if victim in f}
    victim = rng.choice([*blobs, *manifests, "journal.jsonl"])
    original = tree[victim]
    data = bytearray(original)
    if kind == "flip":
        off = rng.randrange(len(data))
        data[off] ^= 1 << rng.randrange(8)
        tree[victim] = bytes(data)
        hit = range(off, off + 1)
    else:
        off = rng.randrange(len(data))
        tree[victim] = bytes(data[:off])
        hit = range(off, len(data))
    what = f"{kind} at {off} of {victim} ({len(data)} bytes)"
    if victim != "journal.jsonl":
        return tree, what, {s for s, f in files_of.items() if victim in f}
    damaged: set[int] = set()
    for start, end, ev in _line_spans(original):
        touched = start < hit.stop and hit.start < end
        if touched and ev["event"] == "init":
            return tree, what, None
        if touched and ev["event"] == "commit":
            damaged.add(int(ev["step"]))
    return tree, what, damaged


def _restore(where: Path, full: bool) -> tuple[int, dict[str, torch.Tensor]]:
    if full:
        model, opt = _build()
        with CheckpointManager(where, keep_last=10) as mgr:
            mgr.register(model=model, optimizer=opt)
            step = mgr.restore()
        return step, _flat(model, opt)
    store = open_store(where)
    state = store.journal.read()
    tried = 0
    for record in candidates(state.records):
        try:
            loaded = load_checkpoint(store.storage, store.blobs, record, state.store_id, workers=1)
        except CheckpointCorrupt:
            tried += 1
            continue
        keep = ("model/", "optimizer/state/")
        return record.step, {k: v for k, v in loaded.tensors.items() if k.startswith(keep)}
    if tried:
        raise NoCheckpointError("no checkpoint verifies")
    return 0, {}


def _same(now: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> bool:
    return now.keys() == ref.keys() and all(
        now[k].dtype == v.dtype and now[k].contiguous().numpy().tobytes() == v.contiguous().numpy().tobytes()
        for k, v in ref.items()
    )


def test_media_faults_never_load_corrupt_data(tmp_path: Path) -> None:
    refs = _make_store(tmp_path / "store", seed=0)
    _make_store(tmp_path / "other", seed=1)
    tree, foreign = read_tree(tmp_path / "store"), read_tree(tmp_path / "other")
    tree = {k: v for k, v in tree.items() if k.startswith(("blobs/", "manifests/")) or k == "journal.jsonl"}
    files_of = _files_of(tree)
    rng = random.Random(7)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    scratch = Path(tempfile.mkdtemp(prefix="smartckpt-media-", dir=base))
    counts = dict.fromkeys(KINDS, 0)
    refusals, empty, wrong = 0, 0, []
    try:
        for n in range(CASES):
            kind = KINDS[n % len(KINDS)]
            damaged_tree, what, damaged = _inject(tree, foreign, files_of, rng, kind)
            counts[kind] += 1
            intact = [s for s in STEPS if damaged is not None and s not in damaged]
            materialise(damaged_tree, scratch)
            try:
                got, now = _restore(scratch, full=n % FULL_EVERY == 0)
            except (NoCheckpointError, JournalError) as err:
                refusals += 1
                if intact:
                    wrong.append(f"{what}: refused ({err}) though step {max(intact)} is intact")
                continue
            except Exception as err:  # anything else is a failed restore
                wrong.append(f"{what}: {type(err).__name__}: {err}")
                continue
            finally:
                clear_files(scratch)
            expected = max(intact) if intact else None
            if got == 0 and expected is None:  # the cut journal lists no commit: nothing to load
                empty += 1
                continue
            if got != expected or not _same(now, refs[got]):
                wrong.append(f"{what}: restored step {got}, expected {expected}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"\nmedia faults: {CASES} injected ({', '.join(f'{k} {v}' for k, v in counts.items())}), "
        f"{refusals} clean refusals, {empty} journals cut before every commit (restore starts at 0), "
        f"{len(wrong)} wrong or failed restores"
    )
    assert not wrong, wrong[:5]
