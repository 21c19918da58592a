"""How long does ``smartckpt plot`` take on a week of traces?

Builds a synthetic store that looks like a week-long fine-tune under ``smartckpt run``: 2 million
trace rows (one evaluation every 0.3 s for 7 days) in one trace file per process, 12 failures
(SIGKILL, OOM, hang, in turn), each restarted from the newest checkpoint and replaying the steps
since; a checkpoint every 400 rows (scheduled, budget, some precursors, the last one final),
``keep_last`` 3 so that all but the newest are pruned; loss spikes; a ``memory`` column. The
journal and the run record are written as the real ones are (same events, same fields), the
trace files in the trace writer's format.

Then times, on the files:

- ``smartckpt plot DIR -o week.png`` as a user runs it (a new process: interpreter, imports,
  reading, building, drawing, writing), best of ``--reps``;
- the same steps in this process, one by one: load (journal, traces, run records), build
  (placement, derived series, min/max decimation), draw, save.

No torch needed. ``python benchmarks/plot_speed.py [--rows 2000000] [--reps 3] [--workdir DIR] [--keep]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("smartckpt_cli") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import _record  # noqa: E402
import numpy as np  # noqa: E402

from smartckpt_cli.store.journal import encode_line  # noqa: E402

CAUSES = [("signal", "killed by SIGKILL"), ("oom", "killed by the OOM killer"), ("hang", "hung")]


def _write_trace(
    path: Path, steps: np.ndarray, times: np.ndarray, rng: np.random.Generator, decisions: dict[int, str]
) -> None:
    n = len(steps)
    loss = 2.5 * np.exp(-steps / 2e6) + 0.3 + rng.normal(0, 0.02, n)
    spikes = rng.random(n) < 2e-5
    loss[spikes] += rng.uniform(0.5, 3.0, spikes.sum())
    curv = rng.normal(0, 1e-3, n)
    var = 1e-4 * np.exp(rng.normal(0, 0.3, n))
    upd = 1e-3 * np.exp(rng.normal(0, 0.2, n))
    score = 1 / (1 + np.exp(-rng.normal(-4, 1.5, n)))
    mem = 0.55 + 0.1 * np.sin(steps / 5e4) + rng.normal(0, 0.01, n)
    with open(path, "w") as f:
        f.write("step,time,loss,curvature,grad_var,update,memory,score,decision\n")
        for start in range(0, n, 200_000):  # in blocks: one formatted string per block
            sl = slice(start, start + 200_000)
            cols = zip(
                steps[sl].tolist(), times[sl].tolist(), loss[sl].tolist(), curv[sl].tolist(),
                var[sl].tolist(), upd[sl].tolist(), mem[sl].tolist(), score[sl].tolist(), strict=True,
            )  # fmt: skip
            f.write(
                "".join(
                    f"{s},{t:.3f},{a:.6g},{b:.6g},{c:.6g},{d:.6g},{m:.6g},{e:.6g},{decisions.get(s, '')}\n"
                    for s, t, a, b, c, d, m, e in cols
                )
            )


def build_store(root: Path, rows: int, seed: int = 0) -> dict[str, int]:
    """The synthetic week (see the module docstring); returns its counts."""
    rng = np.random.default_rng(seed)
    (root / "traces").mkdir(parents=True)
    (root / "runs").mkdir()
    dt, every, failures = 0.3, 400, 12
    t0 = 1.80e9
    cuts = np.sort(rng.choice(np.arange(rows // 20, rows - rows // 20), failures, replace=False))
    events: list[dict] = [{"event": "init", "format": "smartckpt-journal", "v": 1, "store_id": "bench"}]
    attempts = []
    live: list[str] = []
    step, t, row = 1, t0, 0
    newest = 0
    n_ckpt = 0
    for a in range(failures + 1):
        end_row = int(cuts[a]) if a < failures else rows
        n = end_row - row
        steps = np.arange(step, step + n)
        times = t + dt * np.arange(n)
        decisions: dict[int, str] = {}
        last = a == failures
        for s in steps[steps % every == 0].tolist():
            kind = rng.random()
            reason = (
                "lost-work budget"
                if kind < 0.1
                else "precursor: planned update"
                if kind < 0.13
                else "interval 120s"
            )
            decisions[s + 1 if reason.startswith("precursor") else s] = reason
            cid = f"{n_ckpt:012x}"
            n_ckpt += 1
            events.append({"event": "commit", "step": s, "id": cid, "manifest": f"manifests/{s:012d}-{cid}.json",
                           "manifest_hash": "0" * 32, "health": "ok", "calm": kind >= 0.1, "reason": reason,
                           "score": 0.1, "bytes_new": 1, "bytes_total": 1})  # fmt: skip
            live.append(cid)
            if len(live) > 3:
                events.append({"event": "prune", "ids": [live.pop(0)]})
            newest = s
        if last:
            s = int(steps[-1]) + 1
            cid = f"{n_ckpt:012x}"
            n_ckpt += 1
            events.append({"event": "commit", "step": s, "id": cid, "manifest": f"manifests/{s:012d}-{cid}.json",
                           "manifest_hash": "0" * 32, "health": "ok", "calm": True, "reason": "final",
                           "score": None, "bytes_new": 1, "bytes_total": 1})  # fmt: skip
        _write_trace(root / "traces" / f"week-{a:02d}.csv", steps, times, rng, decisions)
        ended = float(times[-1]) + 1.0
        category, cause = CAUSES[a % len(CAUSES)] if not last else ("done", "finished")
        att = {"attempt": a, "pid": 1000 + a, "started": float(times[0]) - 20.0, "start_step": int(step) - 1,
               "ended": ended, "max_step": int(steps[-1]), "category": category, "cause": cause}  # fmt: skip
        if not last:  # lost: from the newest checkpoint's time to the death
            lost = float(ended - (times[0] + (newest - step) * dt))
            att.update(restart_from=newest, steps_lost=int(steps[-1]) - newest, seconds_lost=lost)
        attempts.append(att)
        step, t, row = newest + 1, ended + 30.0, end_row
    (root / "journal.jsonl").write_bytes(b"".join(encode_line(e) for e in events))
    record = {"run_id": "20270101-000000-bench0", "command": ["python", "train.py"], "directory": str(root),
              "started": t0 - 30.0, "attempts": attempts, "ended": attempts[-1]["ended"] + 1.0,
              "outcome": "finished", "exit_code": 0, "version": 1}  # fmt: skip
    (root / "runs" / f"{record['run_id']}.json").write_text(json.dumps(record))
    return {"rows": rows, "files": failures + 1, "checkpoints": n_ckpt, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="leave the synthetic store and the figure")
    _record.add_json_argument(p, "plot_speed")
    args = p.parse_args(argv)
    rec = _record.start("plot_speed")
    work = Path(tempfile.mkdtemp(prefix="plot-speed-", dir=args.workdir))
    try:
        store = work / "store"
        t = time.perf_counter()
        counts = build_store(store, args.rows)
        size = sum(f.stat().st_size for f in (store / "traces").iterdir())
        print(
            f"synthetic week: {counts['rows']:,} trace rows in {counts['files']} files ({size / 2**20:,.0f} MiB), "
            f"{counts['checkpoints']:,} checkpoints, {counts['failures']} failures (built in {time.perf_counter() - t:.1f} s)"
        )
        out = work / "week.png"
        walls = []
        for _ in range(args.reps):
            t = time.perf_counter()
            res = subprocess.run(
                [sys.executable, "-m", "smartckpt_cli.cli.app", "plot", str(store), "-o", str(out)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            walls.append(time.perf_counter() - t)
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return 1
        print(
            f"smartckpt plot DIR -o week.png: {min(walls):.2f} s (best of {args.reps}: {', '.join(f'{w:.2f}' for w in walls)})"
        )
        print(f"  {res.stdout.strip()}")

        from smartckpt_cli.figures.base import save
        from smartckpt_cli.figures.timeline import draw_timeline
        from smartckpt_cli.timeline import PlotOptions, build_timeline, load_store

        t = time.perf_counter()
        facts = load_store(store)
        t_load = time.perf_counter() - t
        t = time.perf_counter()
        tl = build_timeline(facts, PlotOptions())
        t_build = time.perf_counter() - t
        t = time.perf_counter()
        fig = draw_timeline(tl)
        t_draw = time.perf_counter() - t
        t = time.perf_counter()
        save(fig, out)
        t_save = time.perf_counter() - t
        points = sum(len(s.value) for s in tl.series.values())
        print(
            f"in one process: load {t_load:.2f} s, build {t_build:.2f} s, draw {t_draw:.2f} s, save {t_save:.2f} s; "
            f"{points:,} points drawn for {len(tl.series)} series, {len(tl.checkpoints):,} checkpoint markers, "
            f"{len(tl.restarts)} restarts"
        )
        rec.add("rows", counts["rows"], "count", "trace rows of the synthetic week")
        rec.add("files", counts["files"], "count", "trace files")
        rec.add("trace_mb", size / 1e6, "MB", "trace files, bytes")
        rec.add("checkpoints", counts["checkpoints"], "count", "checkpoints in the journal")
        rec.add("failures", counts["failures"], "count", "restarts in the run records")
        rec.add(
            "plot_s", min(walls), "s", f"smartckpt plot DIR -o week.png as a new process, best of {args.reps}"
        )
        rec.add("load_s", t_load, "s", "in one process: reading the journal, traces and run records")
        rec.add(
            "build_s", t_build, "s", "in one process: building the timeline (placement, series, decimation)"
        )
        rec.add("draw_s", t_draw, "s", "in one process: drawing")
        rec.add("save_s", t_save, "s", "in one process: writing the PNG")
        rec.add("points", points, "count", "points drawn")
        rec.details.update(walls_s=walls)
        rec.write(args.json)
        print(f"wrote {args.json}")
        if args.keep:
            print(f"kept: {work}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
