"""Three and four ranks: torchrun with gloo on CPU, DDP and FSDP2, real processes, real SIGKILLs.

Above two ranks the order in which DDP sums a gradient over the ranks matters (floating-point
addition is not associative), so a resume is bit-exact only if the resumed job reduces its first
step in the layout the interrupted job had (engine/ddp_layout.py). Each resumed run is compared
bit for bit with an uninterrupted run of the same script at the same world size (``<out>.r<rank>``:
model, optimizer, scheduler, RNG). The scripts: ``tests/scripts/ddp_train.py`` (DDP or FSDP2,
an explicit CheckpointManager or zero-code) and ``tests/scripts/elastic_train.py`` (FSDP2 with a
DistributedSampler, for elastic resume).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._state import assert_same_state
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
ELASTIC = ROOT / "tests" / "scripts" / "elastic_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
TOTAL, EVERY, KILL_AT = 14, 3, 11  # saves at 3, 6, 9, 12; a rank killed before step 12
SMALL = ["--bucket-cap-kb", "0.25"]  # DDP's gradient buckets: one at first, three once rebuilt
LIMIT = "in another order than the interrupted run did"  # the line a resume that is not exact logs


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", SMARTCKPT_RESTART_BACKOFF="0.1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _torchrun(
    nproc: int, args: list[str], cwd: Path, env: dict[str, str], script: Path = SCRIPT
) -> tuple[int, str]:
    return _run([*TORCHRUN, str(nproc), str(script), *args], cwd, env)


def _final(d: Path, prefix: str, nproc: int) -> list[dict[str, Any]]:
    return [torch.load(d / f"{prefix}.r{r}", weights_only=True) for r in range(nproc)]


def _events(journal: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]


def _commits(journal: Path) -> list[dict[str, Any]]:
    return [e for e in _events(journal) if e["event"] == "commit"]


def _part(store: Path, step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s part manifest of the committed checkpoint of ``step``."""
    (commit,) = [c for c in _commits(store / "journal.jsonl") if c["step"] == step]
    return dict(json.loads((store / commit["parts"][rank][0]).read_text()))


def _starts(out: str, nproc: int) -> set[int]:
    found = {int(r): int(s) for r, s in re.findall(r"rank (\d+) start (\d+)", out)}
    assert sorted(found) == list(range(nproc)), out[-3000:]
    return set(found.values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Callable[..., list[dict]]:
    """``reference(nproc, *args)``: the final states of an uninterrupted run, made once per
    configuration."""
    made: dict[tuple[Any, ...], list[dict]] = {}

    def get(nproc: int, *args: str) -> list[dict]:
        key = (nproc, *args)
        if key not in made:
            d = tmp_path_factory.mktemp("reference")
            run = ["--dir", "ck", "--every", str(EVERY), "--total", str(TOTAL), "--out", "ref", *args]
            rc, out = _torchrun(nproc, run, d, env)
            assert rc == 0, out[-3000:]
            made[key] = _final(d, "ref", nproc)
        return made[key]

    return get


def _same(run: list[dict], ref: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(run, ref, strict=True)):
        try:
            assert_same_state(a, b)
        except AssertionError as err:
            raise AssertionError(f"rank {rank}: {err}") from None


def _supervised(nproc: int, train: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, dict]:
    """``smartckpt run -- torchrun``: the supervisor restarts the group after the SIGKILL."""
    cmd = [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", str(EVERY), "--"]
    rc, out = _run([*cmd, *TORCHRUN, str(nproc), str(SCRIPT), *train], cwd, env)
    records = list((cwd / "ck" / "runs").glob("*.json"))
    return rc, out, json.loads(records[0].read_text()) if records else {}


def test_ddp_at_three_ranks_rank_sigkilled_under_smartckpt_run_resumes_bit_exact(
    tmp_path: Path, env: dict[str, str], reference: Callable[..., list[dict]]
) -> None:
    """The case that was not exact: 3 ranks, the public API, a save every 3 steps, rank 1
    SIGKILLed before step 12, restarted by the supervisor. The resumed job's DDP gets the bucket
    layout of the interrupted one: the final state equals the uninterrupted run's, bit for bit."""
    train = ["--total", str(TOTAL), "--kill-at", str(KILL_AT), "--kill-rank", "1", "--step-time", "0.1"]
    rc, out, rec = _supervised(3, [*train, "--out", "final"], tmp_path, env)
    assert rc == 0, out[-4000:]
    assert rec["outcome"] == "finished" and rec["restarts"] == 1, out[-3000:]
    resumed = rec["attempts"][0]["restart_from"]
    assert resumed in (6, 9), out[-3000:]
    assert all(f"rank {r} start {resumed}" in out for r in range(3)), out[-3000:]
    assert LIMIT not in out, out[-3000:]
    _same(_final(tmp_path, "final", 3), reference(3))
    for commit in _commits(tmp_path / "ck" / "journal.jsonl"):
        assert commit["world_size"] == 3 and len(commit["parts"]) == 3, commit
    # every part records DDP's rebuilt layout (one bucket, parameters in the order their
    # gradients are ready: the last layer's first)
    part = _part(tmp_path / "ck", resumed, 2)
    assert part["meta"]["ddp"] == {"model": {"buckets": [[3, 2, 1, 0]]}}, part["meta"]


def test_ddp_at_four_ranks_zero_code_with_several_buckets_resumes_bit_exact(
    tmp_path: Path, env: dict[str, str], reference: Callable[..., list[dict]]
) -> None:
    """Zero-code mode at 4 ranks (no smartckpt code but ``start_step()``), DDP with small
    buckets: after its first step DDP reduces in three buckets where it began with one. Rank 2 is
    SIGKILLed; the restarted job finishes bit-exact."""
    train = ["--zero-code", "--total", str(TOTAL), "--kill-at", str(KILL_AT), "--kill-rank", "2", *SMALL]
    rc, out, rec = _supervised(4, [*train, "--step-time", "0.1", "--out", "final"], tmp_path, env)
    assert rc == 0, out[-4000:]
    assert rec["restarts"] == 1, out[-3000:]
    resumed = rec["attempts"][0]["restart_from"]
    assert resumed in (6, 9) and all(f"rank {r} start {resumed}" in out for r in range(4)), out[-3000:]
    assert LIMIT not in out, out[-3000:]
    _same(_final(tmp_path, "final", 4), reference(4, *SMALL))
    part = _part(tmp_path / "ck", resumed, 0)
    buckets = part["meta"]["ddp"]["model"]["buckets"]
    assert len(buckets) == 3 and sorted(i for b in buckets for i in b) == [0, 1, 2, 3], buckets


@pytest.mark.parametrize("nproc", [3, 4])
def test_fsdp2_rank_sigkilled_resumes_bit_exact(
    tmp_path: Path, env: dict[str, str], reference: Callable[..., list[dict]], nproc: int
) -> None:
    """FSDP2 (uneven shards at 3 ranks: 64 rows as 22/22/20): the last rank is SIGKILLed before
    step 12; torchrun again resumes every rank from one committed step, each from its own shard,
    and ends bit-exact."""
    args = ["--mode", "fsdp", "--dir", "ck", "--every", str(EVERY), "--total", str(TOTAL), "--out", "final"]
    kill = ["--kill-at", str(KILL_AT), "--kill-rank", str(nproc - 1), "--step-time", "0.1"]
    rc, out = _torchrun(nproc, [*args, *kill], tmp_path, env)
    assert rc != 0 and "SIGKILL" in out, out[-3000:]
    committed = [c["step"] for c in _commits(tmp_path / "ck" / "journal.jsonl")]
    assert committed and max(committed) in (6, 9), committed
    rc, out = _torchrun(nproc, args, tmp_path, env)
    assert rc == 0, out[-3000:]
    assert _starts(out, nproc) == {max(committed)}
    _same(_final(tmp_path, "final", nproc), reference(nproc, "--mode", "fsdp"))
    # every rank wrote its own shard (rows of the 64-row first layer), none a reference
    rows = [
        _part(tmp_path / "ck", max(committed), r)["entries"]["model/0.weight"]["shape"][0]
        for r in range(nproc)
    ]
    assert sum(rows) == 64, rows


def _ids(out: str, up_to: int) -> list[int]:
    got: list[int] = []
    for _rank, step, ids in re.findall(r"ids (\d+) (\d+) ([\d,]+)", out):
        if int(step) <= up_to:
            got += [int(i) for i in ids.split(",")]
    return got


def _same_tree(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _same_tree(u, v, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize(("before", "after"), [(4, 3), (3, 4)], ids=["4-to-3", "3-to-4"])
def test_elastic_resume_between_three_and_four_ranks_carries_state_and_data_position(
    tmp_path: Path, env: dict[str, str], before: int, after: int
) -> None:
    """FSDP2 and a DistributedSampler (96 samples, batch 4 per rank). The job stops after step 3
    at ``before`` ranks and comes back at ``after``: the state gathered right after the restore
    equals the one gathered at the save, bit for bit, and the epoch sees every sample exactly once
    (the rest of it dealt to the new ranks), then ends."""
    common = ["--dir", "ck", "--save-every", "3", "--samples", "--dump", "."]
    rc, first = _torchrun(before, [*common, "--total", "12", "--stop-at", "3"], tmp_path, env, ELASTIC)
    assert rc == 0, first[-3000:]
    rest = 96 - 3 * 4 * before  # samples left in the epoch
    steps = -(-rest // (4 * after))  # steps at the new size to finish it
    rc, second = _torchrun(after, [*common, "--total", str(3 + steps)], tmp_path, env, ELASTIC)
    assert rc == 0, second[-3000:]
    assert all(f"rank {r} of {after} start 3" in second for r in range(after)), second[-3000:]
    assert f"written by {before} rank(s), restored on {after}" in second, second[-3000:]
    _same_tree(
        torch.load(tmp_path / "saved-3.pt", weights_only=False),
        torch.load(tmp_path / "restored-3.pt", weights_only=False),
    )
    seen = _ids(first, 3) + _ids(second, 3 + steps)
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(96)) and max(counts.values()) == 1, counts.most_common(3)
    last = _commits(tmp_path / "ck" / "journal.jsonl")[-1]
    assert last["step"] == 3 + steps - (3 + steps) % 3 and last["world_size"] == after, last


@pytest.mark.parametrize(
    ("point", "part_left"),
    [("manifest.renamed", True), ("rank.write", False)],
    ids=["after-its-part", "before-its-part"],
)
def test_a_rank_killed_between_its_part_and_the_commit_leaves_no_commit(
    tmp_path: Path, env: dict[str, str], reference: Callable[..., list[dict]], point: str, part_left: bool
) -> None:
    """4 ranks, DDP (three gradient buckets): rank 2 is SIGKILLed in the save of step 6, once its part manifest is durable
    (or before it wrote anything). Rank 0 never hears rank 2's verdict: no commit line for step 6,
    whatever the other parts did; the job comes back from step 3 on every rank and ends
    bit-exact."""
    faults = {"SMARTCKPT_TEST_FAULTS": "1", "SMARTCKPT_FAULT": f"{point}@2", "SMARTCKPT_FAULT_RANK": "2"}
    args = ["--dir", "ck", "--every", str(EVERY), "--total", str(TOTAL), "--out", "final"]
    rc, out = _torchrun(4, [*args, "--step-time", "0.05", *SMALL], tmp_path, {**env, **faults})
    assert rc != 0, out[-3000:]
    assert [c["step"] for c in _commits(tmp_path / "ck" / "journal.jsonl")] == [3], out[-3000:]
    dead = {f"manifests/{p.name}" for p in (tmp_path / "ck" / "manifests").glob("000000000006-*-r*.json")}
    assert any(p.endswith("-r2.json") for p in dead) == part_left, dead
    rc, out = _torchrun(4, [*args, *SMALL], tmp_path, env)
    assert rc == 0, out[-3000:]
    assert _starts(out, 4) == {3}
    _same(_final(tmp_path, "final", 4), reference(4, *SMALL))
    # the dead save's parts never enter a commit line (step 6 is committed again, with new parts)
    committed = [c for c in _commits(tmp_path / "ck" / "journal.jsonl") if c["step"] == 6]
    assert len(committed) == 1 and not dead & {p[0] for p in committed[0]["parts"]}, (dead, committed)


def test_a_comm_hook_at_three_ranks_is_reported_and_the_resume_is_close(
    tmp_path: Path, env: dict[str, str], reference: Callable[..., list[dict]]
) -> None:
    """A communication hook lives on DDP's reducer, which smartckpt cannot build again with the
    hook: the resume says so in one line (rank 0), and the result is close to the uninterrupted
    run's, not bit-exact."""
    args = ["--dir", "ck", "--every", str(EVERY), "--total", str(TOTAL), "--out", "final", "--comm-hook"]
    rc, out = _torchrun(
        3, [*args, "--kill-at", str(KILL_AT), "--kill-rank", "1", "--step-time", "0.1"], tmp_path, env
    )
    assert rc != 0, out[-3000:]
    rc, out = _torchrun(3, args, tmp_path, env)
    assert rc == 0, out[-3000:]
    lines = [
        ln for ln in out.splitlines() if LIMIT in ln and not ln.startswith("smartckpt: the resume is not")
    ]
    assert len(lines) == 1 and "communication hook (allreduce_hook)" in lines[0], out[-3000:]
    # the resume check's line, if the first step came out other than before, names that cause
    checks = [ln for ln in out.splitlines() if ln.startswith("smartckpt: the resume is not exact")]
    assert all("known cause: DDP 'model'" in ln for ln in checks), checks
    assert "over the 3 ranks" in lines[0] and "close to the uninterrupted run's, not bit-exact" in lines[0]
    for got, want in zip(_final(tmp_path, "final", 3), reference(3), strict=True):
        for k in want["model"]:
            assert torch.allclose(got["model"][k], want["model"][k], rtol=0, atol=1e-6), k
