"""What a save costs in host memory and in stall, against torch.save and DCP, at two state sizes.

For each contender and each state size, a fresh process (its own allocator, nothing left over
from another contender) builds the bench MLP (about ``--params`` parameters, AdamW moments after
one real step: S = every tensor of the model's and the optimizer's state), trains, and saves every
``--every`` steps, ``--saves`` times:

* ``torch.save`` of the model's and the optimizer's state dicts (blocking, no copy);
* DCP ``async_save`` with its default stager, and with ``DefaultStager`` (shared memory, async
  staging: its "pinned/shared-memory stager"; pinning needs CUDA), a gloo group of one;
* smartckpt's API (``CheckpointManager``, saves through ``mgr.step``: the loop's path);
* smartckpt as under ``smartckpt run`` (the RAM tier on: ``SMARTCKPT_RAM_AREA`` in /dev/shm),
  with its default one slot and with ``ram_slots`` 2;
* with a ``memory_budget``: half of S (the API: saves in pieces) and 2.5 S (under ``smartckpt
  run``: room for the RAM tier's second slot, which the default ``ram_slots`` 0 then takes);
* a LoRA-shaped model (save_what_changed.py's: a frozen base, rank-8 adapters, AdamW over the
  adapters; S is the whole state) through the API registered whole, with its adapters alone
  (what an ideal save holds), and under ``smartckpt run``.

Measured in that process: a thread samples ``RssAnon + RssShmem`` (/proc/self/status) every
2 ms, plus the RAM area's files (shared memory the process may not have mapped); the peak above
the peak of training alone (model, gradients, moments and a step's transient buffers: sampled
over ``--every`` steps before the contender makes anything), over S, is the **extra host memory**
(its staging buffers included). A save's **stall** is what
the loop's own clock lost to it: the iteration that saved and the next one, against two median
iterations without a save (what a user feels, the same way for every contender), over the time
a ``copy_`` of S bytes into buffers already faulted in takes in the same process, measured after
the saves (so its buffers are not in the memory figure). First save, and the median of the later
ones. Each contender finishes its last save before the process ends.

    python benchmarks/save_memory.py [--sizes 25e6,100e6] [--every 6] [--saves 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/save_memory.py` from a checkout
    sys.path.insert(0, str(ROOT))

import _record  # noqa: E402

CONTENDERS = (
    "torch.save",
    "dcp.async_save",
    "dcp.async_save+shm-stager",
    "smartckpt",
    "smartckpt run (RAM tier)",
    "smartckpt run (ram_slots 2)",
    "smartckpt (memory_budget 0.5 S)",
    "smartckpt run (memory_budget 2.5 S)",
    "smartckpt, LoRA-shaped",
    "smartckpt, LoRA-shaped: adapters alone",
    "smartckpt run, LoRA-shaped",
)
# the contenders with a memory budget: the budget as a multiple of S
BUDGETS = {"smartckpt (memory_budget 0.5 S)": 0.5, "smartckpt run (memory_budget 2.5 S)": 2.5}

CHILD = r"""
import json, os, statistics, sys, threading, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from smartckpt_cli.bench.model import build_model, state_tensors, train_step

who, params, every, saves, work = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
area = os.environ.get("SMARTCKPT_RAM_AREA")

def level():
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssShmem"):
                got[k] = int(v.split()[0]) * 1024
    unmapped = 0
    if area:
        unmapped = sum(p.stat().st_size for p in Path(area).rglob("*") if p.is_file())
        unmapped = max(0, unmapped - got.get("RssShmem", 0))
    return got.get("RssAnon", 0) + got.get("RssShmem", 0) + unmapped

if "LoRA" in who:  # save_what_changed.py's model: a frozen base, rank-8 adapters trained
    sys.path.insert(0, os.environ["SAVE_MEMORY_BENCH_DIR"])
    from save_what_changed import Adapted, Adapters
    width = min(2048, max(64, int((params / 4) ** 0.5)))
    torch.manual_seed(0)
    model = Adapted(width, max(1, round(params / (width * width + width))), 8)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    train_step(model, opt)
else:
    model, opt = build_model(params)
tensors = state_tensors(model, opt)
S = sum(t.numel() * t.element_size() for t in tensors)
frozen = sum(q.numel() * q.element_size() for q in model.parameters() if not q.requires_grad)
train_step(model, opt)  # gradients and moments exist
stop = threading.Event()
peak = [level()]
peak_lock = threading.Lock()  # the loop restarts the peak after the first two saves
def sample():
    while not stop.is_set():
        lv = level()
        with peak_lock:
            peak[0] = max(peak[0], lv)
        time.sleep(0.002)
th = threading.Thread(target=sample, daemon=True)
th.start()
# training's own peak (a step's activations and autograd buffers come and go): what the saves
# add is measured above it, not above the level between steps
for _ in range(every):
    train_step(model, opt)
base = peak[0]

if who.startswith("dcp"):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1)
    stager = None
    if who.endswith("shm-stager"):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                                              use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available()))
    pending = []
    def save(step):
        for f in pending:
            f.result()
        pending.clear()
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        kw = {"async_stager": stager} if stager is not None else {}
        r = dcp.async_save(sd, checkpoint_id=str(work / f"dcp-{step}"), **kw)
        pending.append(getattr(r, "upload_completion", r))
    def finish():
        for f in pending:
            f.result()
elif who == "torch.save":
    def save(step):
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, work / f"ts-{step}.pt")
    def finish():
        pass
else:
    import smartckpt_cli as sc
    share = os.environ.get("SAVE_MEMORY_BUDGET_OF_S")
    mgr = sc.CheckpointManager(str(work / "store"), every_steps=every, keep_last=2, max_interval=1e9,
                               **({"ram_every": 1e9} if area else {}),
                               **({"memory_budget": str(int(S * float(share)))} if share else {}))
    mgr.register(model=Adapters(model) if who.endswith("adapters alone") else model, optimizer=opt)
    mgr.restore()
    save = None
    def finish():
        mgr.wait()

iters, saved_at = [], []
first_peak = None
steps = every * (saves + 1)
for step in range(1, steps + 1):
    t0 = time.perf_counter()
    loss = train_step(model, opt)
    if save is None:
        res = mgr.step(step, loss=loss)
        if res.saved:
            saved_at.append(len(iters))
    elif step % every == 0 and len(saved_at) < saves:
        save(step)
        saved_at.append(len(iters))
    iters.append(time.perf_counter() - t0)
    if first_peak is None and len(saved_at) > 1 and len(iters) == saved_at[1] + 3:
        # the first two saves are done (the second's step and two more): their peak apart from
        # the later saves' (the first save of a partly frozen model copies what the later ones
        # reference; the second frees those copies once it has staged what changed)
        finish()
        time.sleep(0.05)
        with peak_lock:
            first_peak, peak[0] = peak[0], level()
finish()
time.sleep(0.05)
stop.set()
th.join()
peak = peak[0]
first_peak = peak if first_peak is None else first_peak
if save is None:
    mgr.close()

# the memcpy the stalls are measured against: S bytes into buffers faulted in beforehand
dst = [torch.empty_like(t) for t in tensors]
for d in dst:
    d.fill_(0)
copies = []
for _ in range(5):
    t0 = time.perf_counter()
    for d, t in zip(dst, tensors):
        d.copy_(t)
    copies.append(time.perf_counter() - t0)
memcpy = statistics.median(copies)
plain = [t for i, t in enumerate(iters) if i not in saved_at and i - 1 not in saved_at and i > 1]
ref = statistics.median(plain)
stalls = [iters[i] + (iters[i + 1] if i + 1 < len(iters) else ref) - 2 * ref for i in saved_at]
print(json.dumps({"who": who, "state_bytes": S, "frozen_share": frozen / S, "base": base, "peak": peak, "first_peak": first_peak,
                  "extra_over_S": (max(peak, first_peak) - base) / S, "extra_first_over_S": (first_peak - base) / S,
                  "extra_later_over_S": (peak - base) / S,
                  "memcpy_s": memcpy, "step_s": ref, "stalls_s": stalls, "saves": len(saved_at)}))
"""


def run_one(who: str, params: float, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["SAVE_MEMORY_BENCH_DIR"] = str(ROOT / "benchmarks")
    with tempfile.TemporaryDirectory(prefix="smartckpt-save-memory-", dir=args.workdir) as work:
        area = None
        if who.startswith("smartckpt run"):
            area = tempfile.mkdtemp(prefix="smartckpt-save-memory-ram-", dir=args.ram_dir)
            env["SMARTCKPT_RAM_AREA"] = area
            if "ram_slots 2" in who:
                env["SMARTCKPT_RAM_SLOTS"] = "2"
        if who in BUDGETS:
            env["SAVE_MEMORY_BUDGET_OF_S"] = str(BUDGETS[who])
        try:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, who, str(params), str(args.every), str(args.saves), work],
                env=env, capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
        finally:
            if area is not None:
                subprocess.run(["rm", "-rf", area], check=False)
    if out.returncode != 0:
        raise SystemExit(f"{who} at {params:g} parameters failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="25e6,100e6", help="parameter counts, comma-separated")
    ap.add_argument("--every", type=int, default=6, help="steps between saves")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--only", default=None, help="contenders, comma-separated (default: all)")
    ap.add_argument(
        "--workdir", default=None, help="where the checkpoints go (default: a temporary directory)"
    )
    ap.add_argument("--ram-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    _record.add_json_argument(ap, "save_memory")
    args = ap.parse_args()
    if args.saves < 2 or args.every < 3:
        ap.error("--saves must be at least 2 and --every at least 3")
    who = CONTENDERS if args.only is None else tuple(args.only.split(","))
    unknown = [w for w in who if w not in CONTENDERS]
    if unknown:
        ap.error(f"--only: unknown contender(s) {', '.join(unknown)} (known: {', '.join(CONTENDERS)})")
    import torch  # for the record's device and version

    rec = _record.start("save_memory", torch.device("cpu"))
    rows = []
    print(
        f"{'contender':40} {'state':>8} {'mem first':>10} {'mem later':>10} {'first stall':>12} {'later stall':>12}"
    )
    for params in (float(s) for s in args.sizes.split(",")):
        for w in who:
            r = run_one(w, params, args)
            first, later = (
                r["stalls_s"][0] / r["memcpy_s"],
                statistics.median(r["stalls_s"][1:]) / r["memcpy_s"],
            )
            row = {**r, "params": params, "first_stall_over_memcpy": first, "later_stall_over_memcpy": later}
            rows.append(row)
            gb = r["state_bytes"] / 1e9
            print(
                f"{w:40} {gb:7.2f}G {r['extra_first_over_S']:9.2f}S {r['extra_later_over_S']:9.2f}S "
                f"{first:11.2f}x {later:11.2f}x",
                flush=True,
            )
            tag = f"{w} @ {params / 1e6:g}M"  # a size by its parameter count: S differs per model
            rec.add(f"state[{tag}]", gb, "GB", f"{tag}: S, the state's bytes")
            rec.add(f"frozen[{tag}]", r["frozen_share"], "x", f"{tag}: the share of S no optimizer updates")
            rec.add(
                f"extra_memory[{tag}]",
                r["extra_over_S"],
                "x",
                f"{tag}: peak extra host memory (private + shm) / S, the state's bytes",
            )
            rec.add(
                f"extra_first[{tag}]",
                r["extra_first_over_S"],
                "x",
                f"{tag}: the same, during the first two saves",
            )
            rec.add(
                f"extra_later[{tag}]",
                r["extra_later_over_S"],
                "x",
                f"{tag}: the same, during the later saves",
            )
            rec.add(f"first_stall[{tag}]", first, "x", f"{tag}: the first save's stall / a memcpy of S")
            rec.add(f"later_stall[{tag}]", later, "x", f"{tag}: later saves' stall, median / a memcpy of S")
    rec.details.update(every=args.every, saves=args.saves, rows=rows)
    rec.write(args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
