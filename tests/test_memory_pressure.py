"""Memory pressure as a trigger signal: the probe (memory.py), the pure judgement (trigger.py
``MemoryPressure``), and a real out-of-memory kill.

The end-to-end test runs ``tests/scripts/leak_train.py`` inside a memory cgroup it creates (v2
where the unified hierarchy has the memory controller, else v1), sets the limit a few hundred MB
above what the process uses, and lets the leak run into it: the kernel's OOM killer ends the
process with SIGKILL. The newest committed checkpoint must be the memory-pressure save taken just
before, not the last scheduled one, and a fresh run resumes from it bit-exactly. It needs root
and a writable memory controller; elsewhere it is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from smartckpt_cli.trigger.memory import cgroup_ceilings
from smartckpt_cli.trigger.pressure import MemoryPressure

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "leak_train.py"
HEADROOM = 300 << 20  # bytes the limit leaves above what the child uses when it is set
EVERY = 100  # the fixed schedule's steps
LEAK_FROM = 110  # the leak starts after the scheduled save of step 100...
OOM_IN = 50  # ...and fills the headroom in about this many steps: the kill comes before step 200


# ------------------------------------------------------------------ pure judgement


def test_a_steady_climb_alarms_before_the_ceiling_and_once():
    mp = MemoryPressure(high=0.9, min_lead=1.0)
    fired = [t for t in range(40) if mp.judge(t * 0.1, 0.3 + 0.02 * t, save_total=0.0)]
    # 2 % of the ceiling per 0.1 s reaches it 3.5 s after the start: one alarm, when about a
    # second of climbing is left (the lead), not at the first sign of growth
    assert len(fired) == 1 and 24 <= fired[0] <= 26, fired
    # re-armed once back below high - 0.1 and no longer climbing
    for t in range(40, 48):
        assert not mp.judge(t * 0.1, 0.5, save_total=0.0)
    again = [t for t in range(48, 90) if mp.judge(t * 0.1, 0.5 + 0.02 * (t - 48), save_total=0.0)]
    assert len(again) == 1 and 62 <= again[0] <= 64, again


def test_noise_and_a_high_plateau_do_not_alarm_but_a_new_high_does():
    mp = MemoryPressure(high=0.9)
    wobble = [0.93, 0.94, 0.93, 0.935, 0.94, 0.93, 0.94, 0.935, 0.93, 0.94]
    assert not any(mp.judge(t * 1.0, f, save_total=0.0) for t, f in enumerate(wobble))  # a tuned GPU run
    assert mp.judge(11.0, 0.97, save_total=0.0)  # past every earlier reading, above high
    assert not mp.judge(12.0, 0.98, save_total=0.0)  # once per episode


def test_the_lead_grows_with_the_save_time_and_the_evaluation_gap():
    slow, fast = MemoryPressure(), MemoryPressure()
    # the same climb, 1 % per second; a save that takes 20 s to commit must start 40 s early
    slow_at = next(t for t in range(100) if slow.judge(float(t), 0.3 + 0.01 * t, save_total=20.0))
    fast_at = next(t for t in range(100) if fast.judge(float(t), 0.3 + 0.01 * t, save_total=0.0))
    assert fast_at - slow_at >= 38, (slow_at, fast_at)


# ------------------------------------------------------------------ the probe


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_probe_finds_v1_and_v2_limits_and_discounts_reclaimable_cache(tmp_path):
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    _tree(v1, {
        "memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "9\n", "memory.stat": "",
        "job/memory.limit_in_bytes": "1000000\n", "job/memory.usage_in_bytes": "700000\n",
        "job/memory.stat": "cache 300000\ninactive_file 1\ntotal_inactive_file 100000\n",
        "job/step/memory.limit_in_bytes": "9223372036854771712\n", "job/step/memory.usage_in_bytes": "5\n",
        "job/step/memory.stat": "",
    })  # fmt: skip
    _tree(v2, {
        # a container's view: the mount's root is the cgroup /pod
        "memory.max": "2000000\n", "memory.current": "1500000\n", "memory.stat": "anon 1\ninactive_file 500000\n",
        "c/memory.max": "max\n", "c/memory.current": "1400000\n", "c/memory.stat": "inactive_file 0\n",
    })  # fmt: skip
    mountinfo = (
        f"30 25 0:26 / {v1} rw - cgroup cgroup rw,memory\n"
        f"31 25 0:27 /pod {v2} rw - cgroup2 cgroup2 rw\n"
        "32 25 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    )
    found = cgroup_ceilings("4:memory:/job/step\n2:cpu:/\n0::/pod/c\n", mountinfo)
    names = [f[0] for f in found]
    assert names == ["cgroup v1 /job/step", "cgroup v1 /job", "cgroup v1 /", "cgroup v2 /c", "cgroup v2 /"]
    from smartckpt_cli.trigger.memory import _Cgroup

    samples = [_Cgroup(*f).read() for f in found]
    limited = [(s.source, s.used, s.limit) for s in samples if s is not None]
    # v1: usage less the reclaimable page cache; v2 likewise; "max" and v1's huge value: no limit
    assert limited == [("cgroup v1 /job", 600000, 1000000), ("cgroup v2 /", 1000000, 2000000)]


def test_the_probe_reads_this_process():
    from smartckpt_cli.trigger.memory import MemoryProbe

    probe = MemoryProbe()
    try:
        s = probe.read()  # None where no ceiling is set (this machine's own cgroups are unlimited)
        assert s is None or (s.used > 0 and s.limit > 0 and s.fraction == s.used / s.limit)
    finally:
        probe.close()


# ------------------------------------------------------------------ a real OOM kill


class _Cgroup:
    """A memory cgroup made for one test (v2 when its memory controller is on, else v1)."""

    def __init__(self) -> None:
        name = f"smartckpt-test-{uuid.uuid4().hex[:8]}"
        v2 = Path("/sys/fs/cgroup")
        v1 = Path("/sys/fs/cgroup/memory")
        if "memory" in _read(v2 / "cgroup.controllers").split():
            self.version, self.path = 2, v2 / name
            if "memory" not in _read(v2 / "cgroup.subtree_control").split():
                (v2 / "cgroup.subtree_control").write_text("+memory")
        elif (v1 / "memory.limit_in_bytes").is_file():
            self.version, self.path = 1, v1 / name
        else:
            raise OSError(
                "no cgroup memory controller is mounted (v2 at /sys/fs/cgroup or v1 at /sys/fs/cgroup/memory)"
            )
        self.path.mkdir()
        if self.version == 1:
            for f, v in (("memory.swappiness", "0"), ("memory.oom_control", "0")):
                try:
                    (self.path / f).write_text(v)  # no swap to hide in, the OOM killer on
                except OSError:
                    pass
        else:
            try:
                (self.path / "memory.swap.max").write_text("0")
            except OSError:
                pass

    def usage(self) -> int:
        stat = _read(self.path / "memory.stat").split()
        key = "total_inactive_file" if self.version == 1 else "inactive_file"
        cache = int(stat[stat.index(key) + 1]) if key in stat else 0
        return (
            int(_read(self.path / ("memory.usage_in_bytes" if self.version == 1 else "memory.current")))
            - cache
        )

    def limit(self, nbytes: int) -> None:
        if self.version == 2:
            (self.path / "memory.max").write_text(str(nbytes))
            return
        (self.path / "memory.limit_in_bytes").write_text(str(nbytes))
        if (self.path / "memory.memsw.limit_in_bytes").exists():
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(nbytes))

    def oom_kills(self) -> int:
        text = _read(self.path / ("memory.oom_control" if self.version == 1 else "memory.events")).split()
        return int(text[text.index("oom_kill") + 1]) if "oom_kill" in text else -1

    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # the killed process's exit is still being accounted


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.fixture
def cgroup():
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    try:
        cg = _Cgroup()
    except OSError as err:
        pytest.skip(f"cannot create a memory cgroup here: {err}")
    try:
        yield cg
    finally:
        cg.remove()


def _journal(store: Path) -> list[dict]:
    return [json.loads(ln) for ln in (store / "journal.jsonl").read_text().splitlines() if ln.strip()]


def _losses(text: str) -> dict[int, str]:
    return {int(ln.split()[1]): ln.split()[3] for ln in text.splitlines() if ln.startswith("step ")}


@pytest.mark.slow
def test_memory_climbing_to_the_cgroup_limit_saves_before_the_oom_kill(tmp_path, cgroup, child_env):
    store = tmp_path / "store"
    args = [sys.executable, str(SCRIPT), "--dir", str(store), "--every", str(EVERY), "--oom-in", str(OOM_IN)]
    args += ["--leak-from", str(LEAK_FROM)]
    # The child joins the cgroup before exec: all its memory is charged there.
    proc = subprocess.Popen(
        ["sh", "-c", f'echo $$ > "{cgroup.procs()}" && exec "$@"', "sh", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        lines: list[tuple[float, str]] = []
        for ln in proc.stdout:
            lines.append((time.monotonic(), ln))
            if ln.strip() == "ready":
                cgroup.limit(cgroup.usage() + HEADROOM)
                proc.stdin.write("go\n")
                proc.stdin.flush()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    out = "".join(ln for _, ln in lines)
    assert proc.returncode == -signal.SIGKILL, f"rc {proc.returncode}\n{out[-1500:]}\n{err[-3000:]}"
    assert cgroup.oom_kills() >= 1, "killed, but not by the OOM killer"
    last = max(_losses(out))
    commits = [e for e in _journal(store) if e["event"] == "commit"]
    scheduled = [e["step"] for e in commits if e["reason"] == f"every {EVERY} steps"]
    newest = commits[-1]
    assert scheduled and scheduled[-1] >= EVERY, commits
    # The newest checkpoint is the memory-pressure save, after the last scheduled one and before the kill.
    assert newest["reason"] == "memory pressure", commits
    assert scheduled[-1] < newest["step"] <= last, (scheduled, newest["step"], last)
    when = {int(ln.split()[1]): t for t, ln in lines if ln.startswith("step ")}
    print(
        f"\nmemory pressure save at step {newest['step']}, killed after step {last}: "
        f"{last - newest['step']} steps, {when[last] - when[newest['step']]:.2f} s before the kill; "
        f"last scheduled save at step {scheduled[-1]}"
    )
    # the trace (flushed at each save) recorded the memory signal, climbing, and the save it made
    (trace,) = (store / "traces").glob("*.csv")
    rows = [ln.split(",") for ln in trace.read_text().splitlines()]
    col, decision = rows[0].index("memory"), rows[0].index("decision")
    memory = {int(r[0]): float(r[col]) for r in rows[1:]}
    assert rows[-1][decision] == "memory pressure" and int(rows[-1][0]) == newest["step"]
    assert memory[newest["step"]] > memory[LEAK_FROM] + 0.1, memory

    # A fresh run (no cgroup, no leak) resumes from that checkpoint and trains bit-exactly on.
    res = subprocess.run(
        [*args[:-2], "--leak-from", "-1", "--total", str(last), "--no-wait"],
        capture_output=True, text=True, env=child_env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"start {newest['step']}" in res.stdout
    again, before = _losses(res.stdout), _losses(out)
    assert min(again) == newest["step"] + 1 and max(again) == last
    assert all(again[n] == before[n] for n in again), "the resumed run's losses differ"


def test_probe_sees_a_cgroup_limit_set_after_it_started(cgroup, child_env):
    """The limit is read at each reading: a limit set (or changed) while the job runs counts."""
    code = (
        "import sys\nfrom smartckpt_cli.trigger.memory import MemoryProbe\np = MemoryProbe()\n"
        "print(p.read() is None or 'smartckpt-test' not in p.read().source, flush=True)\n"
        "sys.stdin.readline()\ns = p.read()\nprint(s.source, s.limit, flush=True)"
    )
    proc = subprocess.Popen(
        ["sh", "-c", f'echo $$ > "{cgroup.procs()}" && exec "$@"', "sh", sys.executable, "-c", code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "True"
    want = cgroup.usage() + (64 << 20)
    cgroup.limit(want)
    out, _ = proc.communicate("go\n", timeout=60)
    source, limit = out.split()[-3:-1], int(out.split()[-1])
    assert source[1] == f"/{cgroup.path.name}" and abs(limit - want) < 4096  # (v1 rounds to pages)
