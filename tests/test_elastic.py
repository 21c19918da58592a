"""Elastic resume (issue 21): a checkpoint written by N ranks restores on M ranks. Real torchrun
groups (gloo, CPU), FSDP2 with uneven shards, a real DistributedSampler; the state gathered whole
after the restore is compared bit for bit with the state gathered at the save."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"
DDP_SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
EPOCH = 96  # samples


def _launch(nproc: int | None, args: list[str], cwd: Path, env: dict[str, str]) -> str:
    cmd = (
        [sys.executable, str(SCRIPT), "--single", *args]
        if nproc is None
        else [*TORCHRUN, str(nproc), str(SCRIPT), *args]
    )
    proc = subprocess.run(
        cmd, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    return out


def _same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _same(u, v, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.shape, b.shape)
        assert torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


def _ids(out: str, up_to: int | None = None) -> list[int]:
    got: list[int] = []
    for _rank, step, ids in re.findall(r"ids (\d+) (\d+) ([\d,]+)", out):
        if up_to is None or int(step) <= up_to:
            got += [int(i) for i in ids.split(",")]
    return got


@pytest.mark.parametrize(
    ("before", "after"),
    [(2, None), (1, 2), (2, 3), (3, 2)],
    ids=["2-to-1-process", "1-to-2", "2-to-3-uneven", "3-to-2"],
)
def test_fsdp2_state_restored_at_another_world_size_equals_the_saved_state(
    tmp_path, child_env, before, after
):
    """The full state gathered right after the restore at M equals the one gathered at the save
    at N, bit for bit: weights, Adam moments and steps, parameter groups, scheduler. ``None``:
    one plain process without torch.distributed (the model not sharded)."""
    common = ["--dir", "ck", "--save-every", "3", "--dump", "."]
    _launch(before, [*common, "--total", "12", "--stop-at", "6"], tmp_path, child_env)
    out = _launch(after, [*common, "--total", "9"], tmp_path, child_env)
    world = after or 1
    assert all(f"rank {r} of {world} start 6" in out for r in range(world)), out[-3000:]
    saved = torch.load(tmp_path / "saved-6.pt", weights_only=False)
    restored = torch.load(tmp_path / "restored-6.pt", weights_only=False)
    _same(saved, restored)
    assert saved["optimizer"], "the optimizer state was saved"
    # training went on at the new size and committed there
    events = [
        json.loads(x) for x in (tmp_path / "ck" / "journal.jsonl").read_text().splitlines() if x.strip()
    ]
    last = [e for e in events if e["event"] == "commit"][-1]
    assert last["step"] == 9 and last.get("world_size", 1) == world


def test_one_epoch_interrupted_at_two_ranks_and_finished_at_three_sees_every_sample_once(tmp_path, child_env):
    """96 samples, batch 4: 2 ranks stop after 6 steps (48 consumed), 3 ranks deal the other
    48 (4 steps each) and the epoch ends; then the second epoch is exactly a 3-rank epoch."""
    common = ["--dir", "ck", "--save-every", "3", "--samples"]
    first = _launch(2, [*common, "--total", "12", "--stop-at", "6"], tmp_path, child_env)
    second = _launch(3, [*common, "--total", "18"], tmp_path, child_env)
    seen = _ids(first, up_to=6) + _ids(second, up_to=10)
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(EPOCH)) and max(counts.values()) == 1, counts.most_common(3)
    # steps 11..18 are the next epoch, dealt as a 3-rank DistributedSampler deals epoch 1
    from torch.utils.data import DistributedSampler

    expect = []
    for r in range(3):
        s = DistributedSampler(range(EPOCH), num_replicas=3, rank=r, seed=5)
        s.set_epoch(1)
        expect += list(s)[: 8 * 4]
    assert sorted(_ids(second)[len(_ids(second, up_to=10)) :]) == sorted(expect)


def test_killed_at_two_ranks_under_smartckpt_run_and_restarted_at_one_finishes(tmp_path, child_env):
    """`smartckpt run -- torchrun`: rank 0 SIGKILLs itself after step 13 with a checkpoint every
    5 steps; the supervisor gives up (no restarts allowed), and the job comes back on one rank."""
    base = [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "5"]
    train = ["--mode", "fsdp", "--total", "20", "--zero-code", "--step-time", "0.1"]
    env = {**child_env, "OMP_NUM_THREADS": "1", "SMARTCKPT_RESTART_BACKOFF": "0.1"}
    first = subprocess.run(
        [*base, "--max-restarts", "0", "--", *TORCHRUN, "2", str(DDP_SCRIPT), *train, "--kill-at", "13", "--kill-rank", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert first.returncode != 0, first.stdout[-3000:] + first.stderr[-3000:]
    events = [
        json.loads(x) for x in (tmp_path / "ck" / "journal.jsonl").read_text().splitlines() if x.strip()
    ]
    commits = [e for e in events if e["event"] == "commit"]
    assert commits and commits[-1]["step"] == 10 and commits[-1]["world_size"] == 2, commits[-1:]
    second = subprocess.run(
        [*base, "--", *TORCHRUN, "1", str(DDP_SCRIPT), *train],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "rank 0 start 10" in out and "rank 0 step 20 loss" in out, out[-4000:]
    assert "written by 2 rank(s), restored on 1" in out, out[-4000:]


def test_a_checkpoint_of_another_model_is_refused_by_every_rank_in_one_line(tmp_path, child_env):
    """Saved at 2 ranks with 34 hidden units, restored at 3 with 36: rank 0's local shard would
    have fitted (12 rows either way), so the global shapes decide, alike on every rank: no rank
    loads anything, none waits for the others."""
    _launch(2, ["--dir", "ck", "--total", "3", "--save-every", "3"], tmp_path, child_env)
    proc = subprocess.run(
        [*TORCHRUN, "3", str(SCRIPT), "--dir", "ck", "--total", "6", "--width", "36"],
        cwd=tmp_path, env={**child_env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    found = [
        ln.split("StateMismatchError: ", 1)[1] for ln in out.splitlines() if "StateMismatchError: " in ln
    ]
    assert len(found) >= 3 and len(set(found)) == 1, out[-3000:]  # every rank, the same line
    assert re.fullmatch(
        r"model/0\.(weight|bias): checkpoint shape 34(x16)? does not match the model's 36(x16)?", found[0]
    ), found[0]
    assert not re.search(r"rank \d of 3 start", out)  # no rank went on to train
