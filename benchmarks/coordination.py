"""What a save costs in coordination at 2, 4 and 8 ranks (torchrun, gloo, CPU).

Each configuration trains a DDP model (an MLP of about ``--mb`` MB of float32 parameters, AdamW)
under ``python -m torch.distributed.run --nproc_per_node N`` with a CheckpointManager saving every
``--every`` steps (the non-blocking path ``mgr.step()`` takes, training going on meanwhile), one
shared store. Every rank records, with the wall clock of this machine:

* each call into ``torch.distributed`` (which group, how many payload bytes this rank sends), by
  wrapping the functions smartckpt calls: what crosses the wire, not what smartckpt says;
* each agreement of the ranks (``Comm.decide``) and its duration;
* when its part manifest became durable and, on rank 0, when the journal's commit line did.

Per save it reports: the decision agreements since the previous save and what one costs (also
timed back to back, 200 times, with the training stopped), the exchanges of the commit (calls on
the commit group, payload bytes per rank), the time from the last rank's part to the commit line
and from the save's snapshot to the commit line, and the files and bytes the save wrote (from the
manifests: the part manifests, the blobs no earlier checkpoint had, the journal line).

    python benchmarks/coordination.py [--ranks 2 4 8] [--saves 8] [--every 10] [--mb 4] [--rounds 3]

On this 2-core machine 4 and 8 ranks oversubscribe the CPU: every rank's training thread competes
with every other rank's save thread, and the times grow with that, not only with the protocol. The
counts (calls, bytes, files) do not depend on the machine. Method and table: docs/coordination.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("smartckpt_cli") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
OPS = (
    "all_reduce",
    "all_gather",
    "gather",
    "scatter",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
)


# ---------------------------------------------------------------------- one rank (under torchrun)


def _children(vrank: int, n: int) -> int:
    """Ranks a rank sends to in gloo's binomial-tree broadcast (``vrank``: its distance from the
    root)."""
    k, out = 1, 0
    while k < n:
        if vrank < k and vrank + k < n:
            out += 1
        k <<= 1
    return out


def _wire(op: str, a: dict[str, Any], rank: int, n: int) -> tuple[int, int]:
    """(messages, bytes) this rank sends for one call, by the algorithm gloo runs: ring all-reduce
    and all-gather, binomial-tree broadcast, direct gather, scatter and point-to-point."""

    def size(x: Any) -> int:
        return int(x.numel() * x.element_size()) if hasattr(x, "element_size") else 0

    root = next((int(a[k]) for k in ("src", "dst", "group_src", "group_dst") if a.get(k) is not None), 0)
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) * size(a["tensor"]) // n
    if op == "all_gather":
        return n - 1, (n - 1) * size(a["tensor"])
    if op == "gather":
        return (0, 0) if rank == root else (1, size(a["tensor"]))
    if op == "scatter":
        if rank != root:
            return 0, 0
        return n - 1, sum(size(t) for i, t in enumerate(a.get("scatter_list") or []) if i != root)
    if op == "broadcast":
        c = _children((rank - root) % n, n)
        return c, c * size(a["tensor"])
    if op in ("send", "isend"):
        return 1, size(a["tensor"])
    return 0, 0


def _instrument(events: list[dict[str, Any]]) -> None:
    """Wrap the torch.distributed functions (both names: smartckpt calls ``torch.distributed.X``,
    the ``*_object`` helpers call ``distributed_c10d.X``) and smartckpt's exchange points."""
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from smartckpt_cli.engine import coordinator, writer
    from smartckpt_cli.engine import distributed as sc_dist

    depth = threading.local()  # torch's send calls its isend: only the outermost call counts

    def wrap_op(name: str) -> None:
        original = getattr(c10d, name)
        sig = inspect.signature(original)

        def op(*args: Any, **kwargs: Any) -> Any:
            t0 = time.time()
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.n -= 1
                if not depth.n:
                    a = sig.bind_partial(*args, **kwargs).arguments
                    group = a.get("group")
                    msgs, sent = _wire(name, a, dist.get_rank(), dist.get_world_size(group))
                    events.append(
                        {
                            "op": name,
                            "group": id(group) if group is not None else 0,
                            "messages": msgs,
                            "bytes": sent,
                            "thread": threading.current_thread().name,
                            "t0": t0,
                            "t1": time.time(),
                        }
                    )

        setattr(c10d, name, op)
        setattr(dist, name, op)

    for name in OPS:
        wrap_op(name)

    def wrap_method(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def method(*args: Any, **kwargs: Any) -> Any:
            t0 = time.time()
            try:
                return original(*args, **kwargs)
            finally:
                events.append({"mark": label, "t0": t0, "t1": time.time()})

        setattr(owner, name, method)

    wrap_method(sc_dist.Comm, "decide", "decide")
    wrap_method(coordinator.Ranks, "persist", "persist")
    wrap_method(writer.Persister, "write_manifest", "part")
    wrap_method(writer.Persister, "commit", "commit")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    events: list[dict[str, Any]] = []
    _instrument(events)
    from smartckpt_cli import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = max(16, int((args.mb * (1 << 20) / 4 / 2) ** 0.5))  # two width x width layers
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(args.dir, every_steps=args.every, keep_last=10_000)
    mgr.register(model=model, optimizer=opt)
    mgr.restore()
    comm = mgr._coord.comm  # type: ignore[attr-defined]
    groups = {id(comm.decide_group): "decide", id(comm.commit_group): "commit"}
    g = torch.Generator().manual_seed(rank)
    saves: list[dict[str, Any]] = []
    for step in range(args.saves * args.every + 2):
        x = torch.randn(32, width, generator=g)
        loss = F.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        r = mgr.step(step + 1, loss=loss)
        if r.saved:
            saves.append({"step": step + 1, "t": time.time()})
    mgr.close()
    # The agreement alone, back to back, training stopped (what one decision costs).
    dist.barrier()
    idle_from = time.time()
    idle = []
    for _ in range(200):
        t0 = time.perf_counter()
        comm.decide(False, 0)
        idle.append(time.perf_counter() - t0)
    for e in events:
        if "op" in e:
            e["group"] = groups.get(e["group"], "other")
    import smartckpt_cli

    out = {
        "rank": rank,
        "world": world,
        "saves": saves,
        "events": events,
        "idle_decide": idle,
        "idle_from": idle_from,
        "package": smartckpt_cli.__file__,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- the parent


def _written(store: Path) -> list[dict[str, Any]]:
    """Files and bytes each committed checkpoint wrote: its part manifests, the blobs no earlier
    checkpoint referenced, and its journal line."""
    lines = (store / "journal.jsonl").read_text().splitlines()
    seen: set[str] = set()
    out = []
    for line in lines:
        ev = json.loads(line)
        if ev.get("event") != "commit":
            continue
        files, size = 0, len(line) + 1
        for rel, _, _ in ev["parts"]:
            path = store / rel
            files += 1
            size += path.stat().st_size
            for entry in json.loads(path.read_text())["entries"].values():
                for stream in (entry.get("data"), entry.get("patch")):
                    for chunk in (stream or {}).get("chunks", []):
                        if chunk[0] not in seen:
                            seen.add(chunk[0])
                            files += 1
                            size += int(chunk[4])
        out.append({"step": ev["step"], "files": files, "bytes": size, "parts": len(ev["parts"])})
    return out


def _per_save(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Save by save (the i-th persist of every rank is the i-th save): decisions since the previous
    save, the commit's calls, messages and bytes on each rank, and its times."""
    r0 = ranks[0]
    saves = r0["saves"]
    persists = [[e for e in rk["events"] if e.get("mark") == "persist"] for rk in ranks]
    rows = []
    for i, save in enumerate(saves):
        if any(i >= len(p) for p in persists):
            break
        lo = saves[i - 1]["t"] if i else 0.0
        decides = [e for e in r0["events"] if e.get("mark") == "decide" and lo < e["t0"] <= save["t"]]
        calls, sent, msgs, parts = [], [], [], []
        commit = None
        for rk, mine in zip(ranks, persists, strict=True):
            a, b = mine[i]["t0"], mine[i]["t1"]
            inside = [e for e in rk["events"] if a <= e["t0"] and e["t1"] <= b]
            ops = [e for e in inside if e.get("group") == "commit"]
            calls.append(len(ops))
            sent.append(sum(e["bytes"] for e in ops))
            msgs.append(sum(e["messages"] for e in ops))
            parts += [e["t1"] for e in inside if e.get("mark") == "part"]
            if rk["rank"] == 0:
                commit = next((e for e in inside if e.get("mark") == "commit"), None)
        if commit is None or len(parts) != len(ranks):
            continue  # not committed
        rows.append(
            {
                "step": save["step"],
                "decisions": len(decides),
                "decide_ms": [round(1e3 * (e["t1"] - e["t0"]), 3) for e in decides],
                "commit_calls": calls,
                "commit_bytes_sent": sent,
                "commit_messages_sent": msgs,
                "last_part_to_commit_ms": round(1e3 * (commit["t1"] - max(parts)), 2),
                "snapshot_to_commit_ms": round(1e3 * (commit["t1"] - save["t"]), 2),
            }
        )
    return rows


def launch(n: int, args: argparse.Namespace, d: Path) -> dict[str, Any]:
    """One torchrun of ``n`` ranks: every rank's record, and what each save wrote."""
    d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [*TORCHRUN, str(n), __file__, "--worker", "--out", str(d), "--dir", str(d / "ck")]
    cmd += ["--saves", str(args.saves), "--every", str(args.every), "--mb", str(args.mb)]
    proc = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{n} ranks failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(n)]
    decide_ops = [
        e for rk in ranks for e in rk["events"] if e.get("group") == "decide" and e["t0"] >= rk["idle_from"]
    ]
    return {
        "rows": _per_save(ranks)[1:],  # the first save also sets things up (staging, connections)
        "written": _written(d / "ck")[1:],  # the first save writes everything; later ones what changed
        "idle": [1e6 * t for rk in ranks for t in rk["idle_decide"]],
        "decide_calls": len(decide_ops) / (200 * n),
        "decide_messages": sum(e["messages"] for e in decide_ops) / 200,
        "package": ranks[0]["package"],
    }


def summary(n: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of ``n`` ranks: medians over the saves of every round."""
    rows = [r for run in runs for r in run["rows"]]
    written = [w for run in runs for w in run["written"]]
    med = statistics.median
    return {
        "ranks": n,
        "saves": len(rows),
        "decisions_per_save": med(r["decisions"] for r in rows),
        "decide_us_training": med(1e3 * t for r in rows for t in r["decide_ms"]),
        "decide_us_idle": med(t for run in runs for t in run["idle"]),
        "decide_calls_per_rank": med(run["decide_calls"] for run in runs),
        "decide_messages_total": med(run["decide_messages"] for run in runs),
        "package": runs[0]["package"],
        "commit_calls_rank0": med(r["commit_calls"][0] for r in rows),
        "commit_calls_other": med(c for r in rows for c in r["commit_calls"][1:]),
        "commit_messages_rank0": med(r["commit_messages_sent"][0] for r in rows),
        "commit_messages_other": med(m for r in rows for m in r["commit_messages_sent"][1:]),
        "commit_messages_total": med(sum(r["commit_messages_sent"]) for r in rows),
        "commit_sent_rank0_B": med(r["commit_bytes_sent"][0] for r in rows),
        "commit_sent_other_B": med(b for r in rows for b in r["commit_bytes_sent"][1:]),
        "commit_sent_total_B": med(sum(r["commit_bytes_sent"]) for r in rows),
        "last_part_to_commit_ms": med(r["last_part_to_commit_ms"] for r in rows),
        "snapshot_to_commit_ms": med(r["snapshot_to_commit_ms"] for r in rows),
        "files_per_save": med(w["files"] for w in written),
        "bytes_per_save": med(w["bytes"] for w in written),
        "rows": rows,
        "written": written,
    }


UNITS = {
    "decisions_per_save": ("count", "decision agreements of the ranks per save (median)"),
    "decide_us_idle": ("us", "one decision agreement, back to back, training stopped (median)"),
    "decide_us_training": ("us", "one decision agreement during training (median)"),
    "decide_calls_per_rank": ("count", "torch.distributed calls of one decision agreement, per rank"),
    "decide_messages_total": ("count", "messages all ranks send for one decision agreement"),
    "commit_calls_rank0": ("count", "torch.distributed calls of the commit on rank 0, per save"),
    "commit_calls_other": ("count", "torch.distributed calls of the commit on another rank, per save"),
    "commit_messages_rank0": ("count", "messages rank 0 sends for the commit, per save"),
    "commit_messages_other": ("count", "messages another rank sends for the commit, per save"),
    "commit_messages_total": ("count", "messages all ranks send for the commit, per save"),
    "commit_sent_rank0_B": ("B", "bytes rank 0 sends for the commit, per save"),
    "commit_sent_other_B": ("B", "bytes another rank sends for the commit, per save"),
    "commit_sent_total_B": ("B", "bytes all ranks send for the commit, per save"),
    "last_part_to_commit_ms": ("ms", "last rank's part manifest durable -> commit line durable (median)"),
    "snapshot_to_commit_ms": ("ms", "snapshot taken -> commit line durable, training going on (median)"),
    "files_per_save": ("count", "files a save writes: part manifests + new blobs (median)"),
    "bytes_per_save": ("B", "bytes a save writes: manifests + new blobs + journal line (median)"),
}
NOTES = [
    "4 and 8 ranks oversubscribe a 2-core machine: its times include waiting for a CPU",
    "the first save of each run (set-up) is left out; the others are non-blocking saves",
    "messages and bytes sent are counted per call from the algorithm gloo runs (ring all-reduce "
    "and all-gather, binomial-tree broadcast, direct gather, scatter and point-to-point)",
]


def _figures(results: list[dict[str, Any]]) -> list[tuple[str, float, str, str]]:
    out = []
    for res in results:
        for key, (unit, what) in UNITS.items():
            value = res.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out.append((f"{key}_{res['ranks']}", float(value), unit, f"{what}, {res['ranks']} ranks"))
    return out


def _write_result(path: str, args: argparse.Namespace, results: list[dict[str, Any]], t0: float) -> None:
    """The result file, in docs/benchmarks.md's format (``benchmarks/_record.py`` writes it where
    that module exists)."""
    import torch

    details = {"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "dir")}}
    details["per_world"] = results
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import _record  # type: ignore[import-not-found]
    except ImportError:
        _record = None
    if _record is not None:
        rec = _record.start("coordination")
        for key, value, unit, what in _figures(results):
            rec.add(key, value, unit, what)
        rec.notes.extend(NOTES)
        rec.details.update(details)
        rec.write(path)
        return
    import platform

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            model,
        )
    record = {
        "format": "smartckpt-bench-result",
        "version": 1,
        "benchmark": "coordination",
        "command": " ".join(["python", "benchmarks/coordination.py", *sys.argv[1:]]),
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(
            git("status", "--porcelain", "--", "smartckpt_cli", "hooks", "benchmarks/coordination.py")
        ),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "seconds": round(time.time() - t0, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": {"type": "cpu", "name": model},
        "machine": {
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "cpu_model": model,
            "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        },
        "figures": {k: {"value": v, "unit": u, "what": w} for k, v, u, w in _figures(results)},
        "notes": NOTES,
        "details": details,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--every", type=int, default=10, help="a save every this many steps")
    ap.add_argument("--mb", type=float, default=4.0, help="parameters of the model, MB")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every world size, in turn")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "coordination.json"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if min(args.ranks) < 2 or args.saves < 2 or args.every < 1 or args.mb <= 0 or args.rounds < 1:
        ap.error("--ranks of at least 2, --saves of at least 2, a positive --every, --mb and --rounds")
    t0 = time.time()
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.ranks}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for i in range(args.rounds):  # the world sizes in turn, each round starting elsewhere
            for n in args.ranks[i % len(args.ranks) :] + args.ranks[: i % len(args.ranks)]:
                runs[n].append(launch(n, args, Path(tmp) / f"round{i}-w{n}"))
    results = []
    for n in args.ranks:
        res = summary(n, runs[n])
        results.append(res)
        print(
            f"{n} ranks: {res['decisions_per_save']:g} decisions/save, one {res['decide_us_idle']:.0f} us idle, "
            f"{res['decide_messages_total']:g} messages; "
            f"commit calls rank 0 {res['commit_calls_rank0']:g}, other {res['commit_calls_other']:g}; "
            f"messages rank 0 {res['commit_messages_rank0']:g}, other {res['commit_messages_other']:g}, "
            f"all {res['commit_messages_total']:g}; sent by all {res['commit_sent_total_B']:.0f} B; "
            f"last part -> commit {res['last_part_to_commit_ms']:.1f} ms; "
            f"snapshot -> commit {res['snapshot_to_commit_ms']:.1f} ms; "
            f"{res['files_per_save']:g} files, {res['bytes_per_save'] / 1e6:.2f} MB per save",
            flush=True,
        )
    _write_result(args.json, args, results, t0)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
