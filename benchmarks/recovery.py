"""Recovery after a SIGKILL: kill -> first resumed step, and the work lost, per set-up.

A training script (the bench MLP of ``--params`` parameters with AdamW, batch 8, CPU) runs under a
restarter; at a random step after ``--warmup`` steps the benchmark SIGKILLs the training process
(not the supervisor) and measures, from the kill:

* ``kill_to_first_step`` — seconds from the kill to the end of the first step the restarted
  process trains (wall clock; the script writes ``step, wall time, pid`` after every step);
* ``steps_lost`` / ``seconds_lost`` — the steps trained again: the step at the kill minus the
  step the restart began at, and the seconds the first run had spent on them (when the restart
  began at step 0: from the killed run's first step, its start-up not counted);
* for the ``smartckpt run`` set-ups, the phases of the restart from the run record
  (``attempts[1].phases``: ``detection`` death -> noticed, ``relaunch`` noticed -> started,
  ``imports`` start -> torch imported, ``to_restore`` start -> restore began (imports, building
  the model), ``restore``, ``to_first_step`` restore done -> first step done) and ``detected``:
  kill -> the next attempt started (detection, flash persist, backoff, spawn).

Set-ups, interleaved (kill 1 of every set-up, then kill 2, ...), medians over ``--kills``:

* ``disk``  — ``smartckpt run --every N`` with the RAM tier off (``SMARTCKPT_RAM=false``) and no
  warm restart (``SMARTCKPT_WARM_RESTART=false``): what a restart cost before either existed;
* ``ram``   — the same with the RAM tier on (``--ram-every``, default 1 s): the restart restores
  from shared memory (the supervisor first persists the newer RAM snapshot to disk);
* ``warm``  — the RAM tier and a warm restart (the default of ``smartckpt run``): the restart
  runs in the spare interpreter prepared while the first attempt trained. The kill comes at the
  first step past the chosen one at which the supervisor has said its spare is ready (a crash
  later than the first seconds of a run, which is when crashes cost anything);
* ``warm-disk`` — a warm restart with the RAM tier off: the restart restores from disk;
* ``torch`` — a plain loop: ``torch.save`` every N steps (tmp + rename), ``torch.load`` at start,
  restarted by the benchmark itself (no supervisor, no checks).

* ``dlrover`` — the anchor: DLRover 0.6.1's flash checkpoint (``benchmarks/recovery_anchor.py``),
  the same model, batch and threads under ``dlrover-run --standalone``, a memory checkpoint every
  ``--dlrover-mem-every`` steps (default 1, its best case), restarted by DLRover's own agent;
  install it first with ``bash benchmarks/install_anchors.sh`` (into ``.anchors/dlrover``).

The restart backoff is 0 for every ``smartckpt run`` set-up (``SMARTCKPT_RESTART_BACKOFF=0``):
what the default does after an attempt that committed past its start (a restart at once), here
also after one killed before its first commit.

    python benchmarks/recovery.py --params 4000000 --kills 5 --json recovery_small.json
    python benchmarks/recovery.py --params 100000000 --kills 3 --json recovery_100m.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

TRAIN = r"""
import os, sys, time
params, every, mode, progress = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
from smartckpt_cli.bench.model import train_step
# the bench MLP (bench/model.py), built without its first step: the manager exists before
# any optimizer steps (else zero-code mode would report the start for it)
width = min(4096, max(64, int((params / 4) ** 0.5)))
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(max(1, round(params / (width * width + width))))])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
attempt = int(os.environ.get("SMARTCKPT_ATTEMPT", os.environ.get("BENCH_ATTEMPT", "0")))
if mode == "torch":
    path = os.path.join(os.path.dirname(progress), "plain.pt")
    start = 0
    if os.path.exists(path):
        ck = torch.load(path, weights_only=True)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["optimizer"]); start = ck["step"]
    mgr = None
else:
    import smartckpt_cli as sc
    mgr = sc.CheckpointManager()
    mgr.register(model=model, optimizer=opt)
    start = mgr.restore()
out = open(progress, "a", buffering=1)
out.write(f"{start} {time.time():.6f} {os.getpid()} {start}\n")  # the start marker
step = start
while True:
    step += 1
    loss = train_step(model, opt)
    if mgr is not None:
        mgr.step(step, loss)
    elif step % every == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
    out.write(f"{step} {time.time():.6f} {os.getpid()} {start}\n")
    if attempt > 0 and step >= start + 3:
        break
if mgr is not None:
    mgr.close()
"""


def _lines(progress: Path) -> list[tuple[int, float, int, int]]:
    if not progress.exists():
        return []
    out = []
    for ln in progress.read_text().splitlines():
        parts = ln.split()
        if len(parts) == 4:
            out.append((int(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])))
    return out


def one_kill(setup: str, args: argparse.Namespace, kill_at: int, work: Path) -> dict[str, Any]:
    """One training run killed once at ``kill_at``; the figures of its recovery."""
    if setup == "dlrover":
        return _dlrover(args, kill_at)
    work.mkdir(parents=True)
    script = work / "train.py"
    script.write_text(TRAIN)
    progress = work / "progress.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SMARTCKPT_RESTART_BACKOFF="0")
    env = {k: v for k, v in env.items() if not k.startswith("SMARTCKPT_") or k == "SMARTCKPT_RESTART_BACKOFF"}
    cmd = [sys.executable, str(script), str(args.params), str(args.every), setup, str(progress)]
    log = None
    if setup == "torch":
        procs = [subprocess.Popen(cmd, env=dict(env, BENCH_ATTEMPT="0"), cwd=work)]
    else:
        if setup in ("disk", "warm-disk"):
            env["SMARTCKPT_RAM"] = "false"
        elif args.ram_every > 0:  # 0: the default cadence (2 % of the step time)
            env["SMARTCKPT_RAM_EVERY"] = str(args.ram_every)
        env["SMARTCKPT_WARM_RESTART"] = "true" if setup.startswith("warm") else "false"
        run = [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", str(work / "ck"), "--every",
               str(args.every), "--", *cmd]  # fmt: skip
        log = (work / "run.log").open("w")
        procs = [subprocess.Popen(run, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT)]
    deadline = time.time() + args.timeout
    while True:
        seen = _lines(progress)
        ready = not setup.startswith("warm") or "waits for the next restart" in (work / "run.log").read_text()
        if seen and seen[-1][0] >= kill_at and ready:
            break
        if time.time() > deadline or procs[0].poll() is not None:
            raise RuntimeError(f"{setup}: the run did not reach step {kill_at}")
        time.sleep(0.005)
    _, _, pid, _ = seen[-1]
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    if setup == "torch":
        procs[0].wait()
        procs.append(subprocess.Popen(cmd, env=dict(env, BENCH_ATTEMPT="1"), cwd=work))
    for p in procs[-1:]:
        p.wait(timeout=args.timeout)
    if log is not None:
        log.close()
    seen = _lines(progress)
    killed_step = max(s for s, _, p, _ in seen if p == pid)
    after = [x for x in seen if x[2] != pid and x[0] > x[3]]  # steps, not the start marker
    if not after:
        raise RuntimeError(f"{setup}: the restarted run trained no step")
    _, first_time, _, began = after[0]
    spent = [t for s, t, p, _ in seen if p == pid]
    t_began = next((t for s, t, p, _ in seen if p == pid and s == began), None)
    res: dict[str, Any] = {
        "setup": setup,
        "kill_at": killed_step,
        "began_again_at": began,
        "kill_to_first_step": round(first_time - t_kill, 3),
        "steps_lost": killed_step - began,
        "seconds_lost": round(spent[-1] - t_began, 3) if t_began is not None else None,
    }
    if setup != "torch":
        (rec_path,) = (work / "ck" / "runs").glob("*.json")
        rec = json.loads(rec_path.read_text())
        second = rec["attempts"][1]
        res["restored_from"] = second.get("restored_from")
        res["warm"] = second.get("warm")
        res["detected"] = round(second["started"] - t_kill, 3)
        res["phases"] = second.get("phases")
        res["flash_persisted"] = rec["attempts"][0].get("flash_persisted")
    return res


def _dlrover(args: argparse.Namespace, kill_at: int) -> dict[str, Any]:
    """The anchor: DLRover's flash checkpoint under its own agent (recovery_anchor.py), the same
    model, batch and thread count, a memory checkpoint every ``--dlrover-mem-every`` steps."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import recovery_anchor

    r = recovery_anchor.one_kill(args.params, args.dlrover_mem_every, kill_at, args.timeout)
    return {
        "setup": "dlrover",
        "kill_at": kill_at,
        "began_again_at": r["restored_step"],
        "kill_to_first_step": round(r["kill_to_first_step_s"], 3),
        "steps_lost": r["steps_lost"],
        "seconds_lost": None,  # the anchor's worker does not log every step's time
        "detected": round(r["relaunch_s"], 3),  # kill -> the new worker's first line
        "phases": {
            "imports": round(r["imports_s"], 3),
            "restore": round(r["restore_s"], 3),
            "first_step": round(r["first_step_s"], 3),
        },
    }


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return round(statistics.median(vals), 3) if vals else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=4_000_000)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--every", type=int, default=100, help="disk (and torch.save) checkpoint every N steps")
    p.add_argument("--ram-every", type=float, default=1.0, help="0: the RAM tier's default cadence")
    p.add_argument("--warmup", type=int, default=60, help="kill no earlier than this step")
    p.add_argument("--spread", type=int, default=30, help="kill within this many steps after --warmup")
    p.add_argument(
        "--setups",
        default="disk,ram,torch",
        help="any of disk, ram, warm, warm-disk, torch, dlrover (the anchor: bash benchmarks/install_anchors.sh first)",
    )
    p.add_argument(
        "--dlrover-mem-every", type=int, default=1, help="steps between DLRover's memory checkpoints"
    )
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed if args.seed is not None else time.time_ns())
    setups = args.setups.split(",")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="smartckpt-recovery-") as tmp:
        for k in range(args.kills):
            kill_at = args.warmup + rng.randrange(args.spread)
            for setup in setups:
                r = one_kill(setup, args, kill_at, Path(tmp) / f"{setup}-{k}")
                rows.append(r)
                print(json.dumps(r), flush=True)
    summary = {}
    for setup in setups:
        mine = [r for r in rows if r["setup"] == setup]
        summary[setup] = {
            key: _median(mine, key)
            for key in ("kill_to_first_step", "steps_lost", "seconds_lost", "detected")
        }
        phases = [r["phases"] for r in mine if r.get("phases")]
        if phases:
            keys = dict.fromkeys(k for ph in phases for k in ph)  # in order, every key any run had
            summary[setup]["phases"] = {
                k: round(statistics.median(ph[k] for ph in phases if k in ph), 3) for k in keys
            }
    for fast in ("ram", "warm"):
        if "disk" in summary and fast in summary and summary[fast]["kill_to_first_step"]:
            summary[f"ratio_disk_over_{fast}"] = round(
                summary["disk"]["kill_to_first_step"] / summary[fast]["kill_to_first_step"], 2
            )
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "params": args.params,
        "state_bytes": args.params * 12,
        "kills": args.kills,
        "medians": summary,
        "runs": rows,
    }
    print(json.dumps(result["medians"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
