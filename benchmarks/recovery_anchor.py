"""The anchor for recovery figures: DLRover's flash checkpoint, killed and restarted by its own agent.

DLRover (PyPI ``dlrover``) keeps the newest checkpoint in shared memory owned by its elastic
agent (``dlrover-run``), which restarts a dead worker; the worker then loads that checkpoint from
memory. This script trains the bench model (``smartckpt_cli.bench.model``: the same MLP and
AdamW as every other benchmark here) under ``dlrover-run --standalone``, saves to memory every
``--mem-every`` steps (to disk every 1,000), SIGKILLs the worker at a random step after a warm-up,
and measures, from the worker's own clock (wall time, one machine):

    kill -> relaunch (the new interpreter's first line) -> imports (torch, dlrover) ->
    restore (process group, the model built, load_checkpoint, load_state_dict) -> first resumed step

plus the work lost (steps between the newest memory checkpoint and the kill). Medians over
``--kills`` runs. It needs DLRover in its own directory, away from the project's environment
(its dependencies pin versions the project's do not): ``bash benchmarks/install_anchors.sh``
installs it into ``.anchors/dlrover`` (from PyPI, once).

DLRover 0.6.1 calls torch's ``SubprocessHandler`` without the ``numa_options`` argument torch
2.13 requires: the launcher below passes ``None`` for it (the one shim; nothing else is changed).

    python benchmarks/recovery_anchor.py --params 100000000 --kills 3
    python benchmarks/recovery_anchor.py --params 2000000 --kills 5 --json docs/recovery-data/recovery_anchor-small.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

DLROVER = ROOT / ".anchors" / "dlrover"

LAUNCHER = """
import sys
import dlrover.trainer.torch.elastic_run as er

class _Compat(er.SubprocessHandler):  # torch 2.13 added numa_options; DLRover 0.6.1 omits it
    def __init__(self, *args, **kwargs):
        if len(args) + len(kwargs) == 6:
            kwargs.setdefault("numa_options", None)
        super().__init__(*args, **kwargs)

er.SubprocessHandler = _Compat
from dlrover.trainer.torch.main import main
sys.exit(main())
"""

WORKER = """
import time
T0 = time.time()
import json, os, signal, sys
import torch, torch.distributed as dist
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
from smartckpt_cli.bench.model import build_model, train_step
T_IMPORTED = time.time()
params, mem_every, kill_at, total, work = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                           int(sys.argv[4]), sys.argv[5])
torch.set_num_threads(1)

def say(**kv):
    print("ANCHOR " + json.dumps(kv), flush=True)

dist.init_process_group("gloo")
model, opt = build_model(params)
ck = DdpCheckpointer(os.path.join(work, "ckpt"))
state = ck.load_checkpoint()
start = 0
if state:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    start = int(state["step"])
T_RESTORED = time.time()
say(event="start", pid=os.getpid(), t0=T0, imported=T_IMPORTED, restored=T_RESTORED, start=start)
killed = os.path.exists(os.path.join(work, "killed"))
for step in range(start + 1, total + 1):
    train_step(model, opt)
    if step == start + 1:
        say(event="first_step", step=step, t=time.time())
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
    if step % mem_every == 0:
        ck.save_checkpoint(step, sd, os.path.join(work, "ckpt", f"checkpoint-{step}.pt"),
                           storage_type=StorageType.MEMORY)
    if step % 1000 == 0:
        ck.save_checkpoint(step, sd, os.path.join(work, "ckpt", f"checkpoint-{step}.pt"),
                           storage_type=StorageType.DISK)
    if step == kill_at and not killed:
        open(os.path.join(work, "killed"), "w").close()
        say(event="kill", step=step, t=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    if killed and step >= start + 2:
        break
say(event="end", step=step, t=time.time())
"""


def one_kill(params: int, mem_every: int, kill_at: int, timeout: float) -> dict[str, float]:
    """One run: trained to ``kill_at``, killed, restarted by DLRover's agent, one resumed step."""
    work = Path(tempfile.mkdtemp(prefix="anchor-"))
    shm = Path("/dev/shm")
    shm_before = set(os.listdir(shm)) if shm.is_dir() else None
    try:
        (work / "launch.py").write_text(LAUNCHER)
        (work / "worker.py").write_text(WORKER)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(DLROVER), str(ROOT)]),
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            sys.executable, str(work / "launch.py"), "--standalone", "--nproc_per_node=1", "--max-restarts=1",
            str(work / "worker.py"), str(params), str(mem_every), str(kill_at), str(kill_at + 50), str(work),
        ]  # fmt: skip
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        events = [json.loads(ln[7:]) for ln in run.stdout.splitlines() if ln.startswith("ANCHOR ")]
        starts = [e for e in events if e["event"] == "start"]
        kill = next((e for e in events if e["event"] == "kill"), None)
        firsts = [e for e in events if e["event"] == "first_step"]
        if kill is None or len(starts) < 2 or len(firsts) < 2:
            tail = (run.stdout + run.stderr)[-2000:]
            raise SystemExit(f"DLRover run did not kill and resume (exit {run.returncode}):\n{tail}")
        again, first = starts[1], firsts[1]
        return {
            "relaunch_s": again["t0"] - kill["t"],
            "imports_s": again["imported"] - again["t0"],
            "restore_s": again["restored"] - again["imported"],
            "first_step_s": first["t"] - again["restored"],
            "kill_to_first_step_s": first["t"] - kill["t"],
            "steps_lost": kill["step"] - again["start"],
            "restored_step": again["start"],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        # DLRover's agent leaves its shared-memory checkpoint behind when it exits (seen with
        # 0.6.1: /dev/shm/standalone_<job>_ckpt_shm_0, the state's size): removed here.
        if shm_before is not None:
            for name in set(os.listdir(shm)) - shm_before:
                if "_ckpt_shm_" in name:
                    with contextlib.suppress(OSError):
                        (shm / name).unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--mem-every", type=int, default=1, help="steps between memory checkpoints")
    ap.add_argument("--warmup", type=int, default=5, help="the kill falls at a random step after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--json",
        default=str(ROOT / "docs" / "recovery-data" / "recovery_anchor.json"),
        help="the result file",
    )
    args = ap.parse_args()
    if not (DLROVER / "dlrover").is_dir():
        raise SystemExit(
            f"DLRover is not installed in {DLROVER}: run `bash benchmarks/install_anchors.sh` first"
        )
    rng = random.Random(args.seed)
    runs = []
    for i in range(args.kills):
        kill_at = args.warmup + rng.randint(1, 5)
        r = one_kill(args.params, args.mem_every, kill_at, args.timeout)
        runs.append(r)
        print(
            f"kill {i + 1}/{args.kills} at step {kill_at}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items())
        )
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("median: " + ", ".join(f"{k} {v:.3g}" for k, v in med.items()))
    import _record  # the result-file format of every benchmark here (docs/benchmarks.md)

    rec = _record.start("recovery_anchor")
    labels = {
        "relaunch_s": "kill -> the new worker's first line (DLRover's agent notices and relaunches)",
        "imports_s": "imports in the new worker (torch, dlrover)",
        "restore_s": "process group, building the model, load_checkpoint from memory, load_state_dict",
        "first_step_s": "restored -> first resumed step done",
        "kill_to_first_step_s": "kill -> first resumed step done",
        "steps_lost": "steps trained again (kill step - restored step)",
    }
    for key, label in labels.items():
        rec.add(
            key.removesuffix("_s"),
            med[key],
            "s" if key.endswith("_s") else "steps",
            f"DLRover flash checkpoint: {label} (median)",
        )
    rec.details.update(
        {
            "runs": runs,
            "params": args.params,
            "mem_every": args.mem_every,
            "anchor": "dlrover 0.6.1 flash checkpoint",
        }
    )
    rec.write(args.json)


if __name__ == "__main__":
    main()
