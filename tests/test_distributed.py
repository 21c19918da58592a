"""Many ranks: torchrun with 2 CPU ranks (gloo), DDP and FSDP2, real processes and real SIGKILLs.

The child is ``tests/scripts/ddp_train.py`` under ``python -m torch.distributed.run --standalone
--nproc_per_node 2``; each rank writes its final local state to ``<out>.r<rank>``, compared bit for
bit with an uninterrupted run of the same script.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._state import assert_same_state

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
TOTAL = 20
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def _torchrun(args: list[str], cwd: Path, env: dict[str, str], nproc: int = 2) -> tuple[int, str]:
    proc = subprocess.run(
        [*TORCHRUN, str(nproc), str(SCRIPT), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def _smartckpt_run(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", *args],
        cwd=cwd, env={**env, "SMARTCKPT_RESTART_BACKOFF": "0.1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def _ranks_running_in(cwd: Path) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cwd", "cmdline"]):
        if p.info["cwd"] == str(cwd) and any("ddp_train.py" in a for a in p.info["cmdline"] or []):
            out.append(p.pid)
    return out


def _final(d: Path, prefix: str) -> list[dict]:
    return [torch.load(d / f"{prefix}.r{r}", weights_only=True) for r in (0, 1)]


def _events(journal: Path) -> list[dict]:
    return [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]


def _commits(journal: Path) -> list[int]:
    return [e["step"] for e in _events(journal) if e["event"] == "commit"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, child_env_module) -> dict[str, list[dict]]:
    """Uninterrupted 2-rank runs (DDP and FSDP2) of the same script."""
    d = tmp_path_factory.mktemp("reference")
    out = {}
    for mode in ("ddp", "fsdp"):
        rc, log = _torchrun(
            ["--mode", mode, "--dir", f"ck-{mode}", "--every", "5", "--total", str(TOTAL), "--out", mode],
            d, child_env_module,
        )  # fmt: skip
        assert rc == 0, log
        out[mode] = _final(d, mode)
    return out


@pytest.fixture(scope="module")
def child_env_module() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _same(run: list[dict], ref: list[dict]) -> None:
    for a, b in zip(run, ref, strict=True):
        assert_same_state(a, b)


def test_ddp_rank_sigkilled_under_smartckpt_run_finishes_bit_exact(tmp_path, child_env_module, reference):
    rnd = random.Random(time.time_ns())
    kill_at, kill_rank = rnd.randrange(6, TOTAL - 1), rnd.randrange(2)
    rc, out = _smartckpt_run(
        ["--dir", "ck", "--every", "5", "--", *TORCHRUN, "2", str(SCRIPT), "--total", str(TOTAL),
         "--kill-at", str(kill_at), "--kill-rank", str(kill_rank), "--step-time", "0.05", "--out", "final"],
        tmp_path, child_env_module,
    )  # fmt: skip
    assert rc == 0, f"kill at {kill_at} on rank {kill_rank}\n{out}"
    _same(_final(tmp_path, "final"), reference["ddp"])
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    rec = json.loads(path.read_text())
    assert rec["outcome"] == "finished" and rec["restarts"] == 1, out
    resumed = rec["attempts"][0]["restart_from"]
    # a checkpoint every 5 steps, or the RAM tier's newer snapshot persisted before the restart
    assert resumed <= kill_at, out
    assert resumed % 5 == 0 or resumed == rec["attempts"][0]["flash_persisted"], out
    assert f"rank 0 start {resumed}" in out and f"rank 1 start {resumed}" in out, out
    # every commit of the 2-rank run names both parts and the world size
    for e in _events(tmp_path / "ck" / "journal.jsonl"):
        if e["event"] == "commit":
            assert e["world_size"] == 2 and len(e["parts"]) == 2


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_saves_in_pieces_on_two_ranks_resume_bit_exact(tmp_path, child_env_module, reference, mode):
    """``memory_budget`` below the state (engine/budget.py): every rank copies and writes its part
    a piece at a time (DDP's replicated entries still written once: hashed where they live), the
    RAM tier stands down; a rank SIGKILLed, the run finishes bit-exact."""
    rnd = random.Random(time.time_ns())
    kill_at, kill_rank = rnd.randrange(6, TOTAL - 1), rnd.randrange(2)
    env = {**child_env_module, "SMARTCKPT_MEMORY_BUDGET": "1M"}
    rc, out = _smartckpt_run(
        ["--dir", "ck", "--every", "5", "--", *TORCHRUN, "2", str(SCRIPT), "--mode", mode, "--total", str(TOTAL),
         "--kill-at", str(kill_at), "--kill-rank", str(kill_rank), "--step-time", "0.05", "--out", "final"],
        tmp_path, env,
    )  # fmt: skip
    assert rc == 0, f"kill at {kill_at} on rank {kill_rank}\n{out}"
    _same(_final(tmp_path, "final"), reference[mode])
    assert out.count("is above memory_budget") >= 2 and "RAM tier stands down" in out, out
    commits = [e for e in _events(tmp_path / "ck" / "journal.jsonl") if e["event"] == "commit"]
    assert commits and all(e["world_size"] == 2 for e in commits)
    if mode == "ddp":  # the replicated model: one rank's part references the other's entries
        part = json.loads((tmp_path / "ck" / commits[-1]["parts"][1][0]).read_text())
        assert any("ref" in e for e in part["entries"].values()), part["entries"].keys()


def test_fsdp2_save_kill_restore_same_world_size_bit_exact(tmp_path, child_env_module, reference):
    args = ["--mode", "fsdp", "--dir", "ck", "--every", "5", "--total", str(TOTAL), "--out", "final"]
    rc, out = _torchrun(
        [*args, "--kill-at", "13", "--kill-rank", "0", "--step-time", "0.1"], tmp_path, child_env_module
    )
    assert rc != 0 and "SIGKILL" in out, out
    committed = _commits(tmp_path / "ck" / "journal.jsonl")
    assert committed and max(committed) == 10, committed
    rc, out = _torchrun(args, tmp_path, child_env_module)
    assert rc == 0, out
    assert "rank 0 start 10" in out and "rank 1 start 10" in out, out
    _same(_final(tmp_path, "final"), reference["fsdp"])
    # each rank stored its own shard: rank 1's part holds entries of its own, not refs
    parts = sorted((tmp_path / "ck" / "manifests").glob("*-r1.json"))
    entries = json.loads(parts[-1].read_text())["entries"]
    assert entries["model/0.weight"].get("data") and entries["model/0.weight"]["shape"] == [32, 16]
    # another world size resumes (tests/test_elastic.py compares the state), saying so
    rc, out = _torchrun(
        [*args[:-2], "--out", "one", "--total", str(TOTAL + 2)], tmp_path, child_env_module, nproc=1
    )
    assert rc == 0, out
    assert f"rank 0 start {TOTAL}" in out and "written by 2 rank(s), restored on 1" in out, out


def test_a_save_whose_rank_write_fails_is_never_committed(tmp_path, child_env_module):
    env = {
        **child_env_module,
        "SMARTCKPT_TEST_FAULTS": "1",
        "SMARTCKPT_FAULT": "rank.write@2",  # the second save (step 10) ...
        "SMARTCKPT_FAULT_RANK": "1",  # ... fails on rank 1 only
        "SMARTCKPT_FAULT_MODE": "raise",
    }
    # step 10 is the last step: no later trigger retries the failed save
    rc, out = _torchrun(
        ["--dir", "ck", "--every", "5", "--total", "10", "--step-time", "0.02"], tmp_path, env
    )
    assert rc == 0, out  # no rank hangs, no rank crashes
    assert "rank 0 done 10 failures 1" in out and "rank 1 done 10 failures 1" in out, out
    events = _events(tmp_path / "ck" / "journal.jsonl")
    assert [e["step"] for e in events if e["event"] == "commit"] == [5]
    (failed,) = [e for e in events if e["event"] == "save_failed"]
    assert (
        failed["step"] == 10 and "rank 1" in failed["error"] and "injected write failure" in failed["error"]
    )
    # rank 0 wrote its part of step 10, but it was never committed: a restart resumes from 5
    assert len(list((tmp_path / "ck" / "manifests").glob("000000000010-*-r0.json"))) == 1
    rc, out = _torchrun(["--dir", "ck", "--every", "5", "--total", "12"], tmp_path, child_env_module)
    assert rc == 0 and "rank 0 start 5" in out and "rank 1 start 5" in out, out


def test_a_hung_rank_restarts_the_whole_group(tmp_path, child_env_module, reference):
    rc, out = _smartckpt_run(
        ["--dir", "ck", "--every", "5", "--hang-timeout", "3", "--", *TORCHRUN, "2", str(SCRIPT),
         "--total", str(TOTAL), "--hang-at", "12", "--hang-rank", "1", "--step-time", "0.05", "--out", "final"],
        tmp_path, child_env_module,
    )  # fmt: skip
    assert rc == 0, out
    assert "the child hangs" in out, out
    _same(_final(tmp_path, "final"), reference["ddp"])
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    rec = json.loads(path.read_text())
    assert rec["attempts"][0]["category"] == "hang" and rec["restarts"] == 1
    # nothing of the first attempt survives it: no rank left running
    assert not _ranks_running_in(tmp_path)


def test_missing_node_local_part_makes_both_ranks_fall_back_together(tmp_path, child_env_module):
    args = ["--dir", "local", "--node-local", "--meta-dir", "shared", "--every", "5", "--total", "12"]
    rc, out = _torchrun(args, tmp_path, child_env_module)
    assert rc == 0, out
    assert _commits(tmp_path / "shared" / "journal.jsonl") == [5, 10]
    assert (tmp_path / "local" / "node0" / "dir.id").read_text() != (
        tmp_path / "local" / "node1" / "dir.id"
    ).read_text()
    # node 1 lost its local copy of step 10 (a replaced disk, a wiped /tmp)
    (gone,) = (tmp_path / "local" / "node1" / "manifests").glob("000000000010-*-r1.json")
    gone.unlink()
    rc, out = _torchrun([*args[:-1], "14"], tmp_path, child_env_module)
    assert rc == 0, out
    assert "rank 0 start 5" in out and "rank 1 start 5" in out, out
    assert "cannot be loaded on every rank" in out and "rank 1:" in out and "fall back" in out, out


def test_zero_code_ddp_under_smartckpt_run_resumes_bit_exact(tmp_path, child_env_module, reference):
    """No smartckpt code but ``start_step()``: the hooks arm on every rank under torchrun."""
    rc, out = _smartckpt_run(
        ["--dir", "ck", "--every", "5", "--", *TORCHRUN, "2", str(SCRIPT), "--zero-code", "--total", str(TOTAL),
         "--kill-at", "13", "--kill-rank", "1", "--step-time", "0.05", "--out", "final"],
        tmp_path, child_env_module,
    )  # fmt: skip
    assert rc == 0, out
    assert "rank 0 start 10" in out and "rank 1 start 10" in out, out
    _same(_final(tmp_path, "final"), reference["ddp"])
    commits = [e for e in _events(tmp_path / "ck" / "journal.jsonl") if e["event"] == "commit"]
    # the final checkpoint is taken before destroy_process_group tears the world down
    assert (
        commits[-1]["step"] == TOTAL and commits[-1]["reason"] == "final" and commits[-1]["world_size"] == 2
    )


def test_a_signal_to_one_rank_makes_every_rank_save_at_the_same_step(tmp_path, child_env_module):
    """SIGTERM reaches rank 1 only. Ranks agree every few steps (decision steps, cadence.py), so
    the signal travels with the next agreement: both ranks take the blocking save of one step,
    commit it, and die by SIGTERM; a rerun resumes both from it and ends bit-exactly where an
    uninterrupted run ends."""
    total, at = 100, 15  # room after the signal: ranks agree on it within 1 s (~50 steps)
    ref_args = [
        "--dir",
        "ref",
        "--every",
        "1000",
        "--total",
        str(total),
        "--step-time",
        "0.01",
        "--out",
        "ref",
    ]
    rc, out = _torchrun(ref_args, tmp_path, child_env_module)
    assert rc == 0, out
    args = ["--dir", "ck", "--every", "1000", "--total", str(total), "--step-time", "0.02", "--out", "final"]
    rc, out = _torchrun([*args, "--signal-at", str(at), "--signal-rank", "1"], tmp_path, child_env_module)
    assert rc != 0, out
    commits = [e for e in _events(tmp_path / "ck" / "journal.jsonl") if e["event"] == "commit"]
    assert len(commits) == 1 and commits[0]["reason"] == "preemption (SIGTERM)", commits
    saved = commits[0]["step"]
    assert commits[0]["world_size"] == 2 and len(commits[0]["parts"]) == 2
    # at most a second of 20 ms steps (one decision gap) after the signal, no rank stepped past it
    assert at < saved <= at + 51, (at, saved)
    for r in (0, 1):
        assert f"rank {r} step {saved - 1} " in out and f"rank {r} step {saved} " not in out, out
    rc, out = _torchrun(args, tmp_path, child_env_module)
    assert rc == 0, out
    assert f"rank 0 start {saved}" in out and f"rank 1 start {saved}" in out, out
    _same(_final(tmp_path, "final"), _final(tmp_path, "ref"))


def test_ownership_and_naming_rules():
    from smartckpt_cli.engine.distributed import (
        dir_leaders,
        entry_hash,
        needs_reshard,
        part_rel,
        plan_refs,
    )
    from smartckpt_cli.store.journal import fold

    w, rng0, rng1 = entry_hash("w", "a"), entry_hash("rng", "r0"), entry_hash("rng", "r1")
    hashes = [[w, rng0], [w, rng1], [rng0, w]]  # the entries' order may differ from rank to rank
    # one shared disk: the replicated weight is rank 0's; rank 1's own RNG is its own
    assert plan_refs(hashes, ["d"] * 3) == [{}, {0: 0}, {0: 0, 1: 0}]
    # node-local disks: nothing is shared across disks
    assert plan_refs(hashes, ["n0", "n1", "n1"]) == [{}, {}, {1: 1}]
    # the same bytes under another key are another entry
    assert entry_hash("w", "a") != entry_hash("v", "a") and len(entry_hash("w", "a")) == 32
    assert dir_leaders(["n0", "n1", "n1", "n0"]) == {0, 1}
    assert part_rel(10, "0123456789ab", 1) == "manifests/000000000010-0123456789ab-r1.json"
    cid, h = "0123456789ab", "0" * 32
    parts = [[part_rel(10, cid, r), h, "d"] for r in range(2)]
    two = {"event": "commit", "step": 10, "id": cid, "manifest": parts[0][0], "manifest_hash": h}
    one = {"event": "commit", "step": 9, "id": "ba9876543210", "manifest_hash": h}
    one["manifest"] = "manifests/000000000009-ba9876543210.json"
    _, (rec2, rec1), _ = fold([{**two, "world_size": 2, "parts": parts}, one])
    assert rec2.manifests() == [parts[0][0], parts[1][0]] and rec1.manifests() == [one["manifest"]]
    assert not needs_reshard(rec2, 2) and needs_reshard(rec2, 4)
    assert needs_reshard(rec1, 2) and not needs_reshard(rec1, 1)  # a single-process checkpoint


def test_distributed_setting_is_checked():
    from smartckpt_cli.config import load_settings
    from smartckpt_cli.errors import ConfigError

    assert load_settings(None, {"distributed": "off"})[0].distributed == "off"
    with pytest.raises(ConfigError, match="distributed must be 'auto' or 'off'"):
        load_settings(None, {"distributed": "yes"})


def test_ctrl_c_under_smartckpt_run_with_torchrun_saves_every_rank_and_stops_quietly(
    tmp_path, child_env_module
):
    """Ctrl-C in a terminal (SIGINT to the foreground process group) reaches ``smartckpt run``,
    which passes it to torchrun, which passes it to its workers: every rank takes the blocking
    save of one step, the run ends with 130, no traceback (not torchrun's either), and the summary
    counts no step lost."""
    import os
    import signal

    args = ["--dir", "ck", "--every", "1000", "--", *TORCHRUN, "2", str(SCRIPT), "--zero-code",
            "--total", "400", "--step-time", "0.05"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", *args],
        cwd=tmp_path, env=child_env_module, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        # two ranks share the pipe: a line may hold another rank's line before it
        if any(int(m) >= 20 for m in re.findall(r"rank \d step (\d+) ", line)):
            os.killpg(proc.pid, signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "Traceback" not in out and "SignalException" not in out, out
    commits = [e for e in _events(tmp_path / "ck" / "journal.jsonl") if e["event"] == "commit"]
    assert len(commits) == 1 and commits[0]["reason"] == "preemption (SIGINT)", commits
    assert commits[0]["world_size"] == 2 and commits[0]["step"] >= 20
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    rec = json.loads(path.read_text())
    assert rec["outcome"] == "stopped" and rec["exit_code"] == 130, rec
    assert rec["attempts"][0]["restart_from"] == commits[0]["step"] and rec["steps_lost"] == 0, rec
    assert "no heartbeat from the child yet" not in out, out
