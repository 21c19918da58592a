"""When to save, judged on real traces (issue 4, must-show 2).

Two real fine-tuning runs of all-MiniLM-L6-v2 (pretrained weights, offline; the first
``--layers`` transformer layers, to keep CPU time sane) with AdamW on sentence/next-sentence
pairs (MultipleNegativesRanking loss; see _common.py), each under smartckpt's CheckpointManager
with ``eval_every=1``, so smartckpt's own signals code writes a dense trace (loss median-filtered
over 5 steps, its curvature, the global gradient variance). Neither run saves (a fixed schedule
of 10⁹ steps, a budget of 10⁹ s): saves would only disturb the step times.

1. ``clean``: a plain fine-tune.
2. ``spikes``: the same fine-tune, but at a few chosen steps the learning rate is multiplied by
   ``--spike-factor`` for ``--spike-len`` optimizer steps. The loss really spikes and the
   gradient variance really reacts; nothing is injected into the trace. With
   ``--spike-shape ramp`` the factor is reached geometrically over the ``--spike-len`` steps
   instead: an instability that builds up, whose gradients react before the loss does.

``smartckpt simulate``'s engine then replays each trace under the fixed, seed and adaptive
policies at the same number of checkpoints (see smartckpt_cli/simulate.py for the calibration,
the exact lost-work integral, onset detection and retention). Times are scaled to this machine's
step time s (the median gap between trace rows), so the experiment does not depend on the CPU:
a save costs the loop ``--save-cost`` × s, commits ``--save-total`` × s after it is taken, the
policies' floor and budget are ``--min-interval`` × s and ``--max-interval`` × s, and the MTBF
is ``--mtbf`` × s.

Spike runs also report the *clean* distance: from the last unperturbed state (trace step s for
a perturbation of loop step s) back to the newest retained checkpoint of a step <= s (its
weights were never touched by the perturbation), judged when the loss event ends. A checkpoint
between the perturbation and the detected loss onset counts as "before the onset" for the
issue's metric, but it already holds perturbed weights; the clean distance says whether a
policy kept a state that is actually good.

    python benchmarks/trigger_eval.py [--steps 500] [--layers 2] [--workdir /tmp/te] [--json out.json]
    python benchmarks/trigger_eval.py --reuse /tmp/te    # simulate the traces of an earlier run
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import _common as C
import _record
import torch

from smartckpt_cli import CheckpointManager
from smartckpt_cli.simulate import Onset, SimConfig, SimResult, read_trace, retained_before, simulate


def train(args: argparse.Namespace, data: C.TextData, store: Path, spikes: list[int]) -> dict[str, Any]:
    """One fine-tune under CheckpointManager; returns the losses and the perturbed steps."""
    torch.manual_seed(args.seed)
    model = C.load_minilm(num_layers=args.layers).to(args.dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # loop index -> learning-rate multiplier. "jolt": the full factor at once (no precursor);
    # "ramp": the factor reached geometrically over spike_len steps, an instability that builds
    # up (the gradients react before the loss does).
    perturbed: dict[int, float] = {}
    for s in spikes:
        for j in range(args.spike_len):
            ramp = args.spike_factor ** ((j + 1) / args.spike_len)
            perturbed[s + j] = ramp if args.spike_shape == "ramp" else args.spike_factor
    losses: list[float] = []
    t0 = time.perf_counter()
    with CheckpointManager(
        store, every_steps=10**9, max_interval=1e9, eval_every=args.eval_every, keep_last=1
    ) as mgr:
        mgr.register(model=model, optimizer=opt)
        for i in range(args.steps):
            warm = min(1.0, (i + 1) / args.warmup)
            for g in opt.param_groups:
                g["lr"] = args.lr * warm * perturbed.get(i, 1.0)
            loss = C.pair_loss(model, data.batch(i, args.seed, args.batch))
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            # The trace row of step i+1 holds the state after optimizer step i: perturbed from
            # row min(perturbed)+1 on. Its signals were read in the pre-hook of step i, before
            # that update (the gradients of the weights before it, the planned update with step
            # i's learning rate, the losses up to step i-1), so a precursor save from row i+1
            # holds the state of row i, untouched by update i.
            mgr.step(i + 1, loss=loss.detach())
            losses.append(loss.item())
            if (i + 1) % 50 == 0:
                rate = (time.perf_counter() - t0) / (i + 1)
                print(f"  {store.name}: step {i + 1} loss {losses[-1]:.4f} ({rate:.2f} s/step)", flush=True)
    return {"losses": losses, "seconds": time.perf_counter() - t0}


def sim_config(args: argparse.Namespace, step_s: float, checkpoints: int | None) -> SimConfig:
    return SimConfig(
        mtbf=args.mtbf * step_s,
        save_cost=args.save_cost * step_s,
        save_total=args.save_total * step_s,
        min_interval=args.min_interval * step_s,
        max_interval=args.max_interval * step_s,
        keep_last=args.keep_last,
        checkpoints=checkpoints,
        spike_k=args.spike_k,
    )


def clean_distances(res: SimResult, trace_rows: Any, spikes: list[int], keep_last: int) -> dict[str, Any]:
    """Per policy: for each perturbation that caused a detected onset (within 20 steps), the
    newest retained checkpoint whose weights predate it (trace step <= the perturbed loop step),
    judged when the rollback is decided, and its distance from the last unperturbed state."""
    steps = [r.step for r in trace_rows]
    out: dict[str, Any] = {"detected": []}
    events = []
    for s in spikes:
        ev = next((o for o in res.onsets if s < o.step <= s + 20), None)
        if ev is None:
            continue
        i = min(range(len(steps)), key=lambda k: (abs(steps[k] - s), steps[k]))  # row s: last clean
        if res.config.rollback == "onset":  # decided at the detected onset
            ev = Onset(ev.index, ev.step, ev.time, ev.index, ev.step, ev.time)
        events.append((i, Onset(i, s + 1, trace_rows[i].time, ev.end_index, ev.end_step, ev.end_time)))
        out["detected"].append(s)
    for p in res.policies:
        dists, ckpts = [], []
        for i, fake in events:
            ck = retained_before(list(p.saves), fake, keep_last)
            t = ck.time if ck is not None else trace_rows[0].time
            dists.append(trace_rows[i].time - t)
            ckpts.append(ck.step if ck is not None else None)
        out[p.name] = {"checkpoints": ckpts, "distances": dists}
    return out


def report(name: str, res: SimResult, step_s: float, clean: dict[str, Any] | None) -> list[str]:
    print(
        f"\n[{name}] {res.rows} rows, {res.duration:.1f} s, step time s = {step_s:.3f} s; "
        f"onsets at steps {[o.step for o in res.onsets] or 'none'}\n  calibration: {res.method}"
    )
    head = [
        "policy",
        "setting",
        "ckpts",
        "overhead",
        "lost/failure s",
        "expected lost s",
        "onset dist mean s",
        "max s",
        "rollback lost s",
        "missed",
    ]
    if clean is not None:
        head += ["clean dist mean s", "max s", "retained before perturbation"]
    rows = []
    for p in res.policies:
        row: list[Any] = [
            p.name,
            p.knob,
            p.checkpoints if p.exact_count else f"{p.checkpoints} (!)",
            f"{p.overhead:.2%}",
            p.mean_lost,
            p.expected_lost,
            p.mean_distance if p.onsets else "-",
            p.max_distance if p.onsets else "-",
            p.mean_rollback_lost if p.onsets else "-",
            p.missed if p.onsets else "-",
        ]
        if clean is not None:
            c = clean[p.name]
            d = c["distances"]
            row += [statistics.fmean(d) if d else "-", max(d) if d else "-", c["checkpoints"]]
        rows.append(row)
    print(C.table(head, rows))
    for p in res.policies:
        if p.onsets:
            print(
                f"  {p.name}: onset -> retained checkpoint: "
                + ", ".join(f"{o.step}->{o.checkpoint_step}" for o in p.onsets)
            )
    fixed, adaptive = res.policy("fixed"), res.policy("adaptive")
    lines = [
        f"{name}: adaptive/fixed expected lost work = {adaptive.mean_lost / fixed.mean_lost:.3f} (target <= 1.05)"
    ]
    if res.onsets and adaptive.mean_distance:
        lines.append(
            f"{name}: fixed/adaptive mean onset distance = {fixed.mean_distance / adaptive.mean_distance:.2f}x "
            f"(target >= 2), max {fixed.max_distance / max(adaptive.max_distance or 1e-9, 1e-9):.2f}x"
        )
    if clean is not None and clean["detected"]:
        ca = statistics.fmean(clean["adaptive"]["distances"])
        cf = statistics.fmean(clean["fixed"]["distances"])
        ratio = (
            f"= {cf / ca:.2f}x"
            if ca > 0
            else f"(adaptive {ca:.2f} s: it holds the last unperturbed state itself; fixed {cf:.2f} s)"
        )
        lines.append(
            f"{name}: fixed/adaptive mean clean distance {ratio} "
            f"(perturbations with a detected onset: {clean['detected']})"
        )
    for ln in lines:
        print("  " + ln)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--layers", type=int, default=2, help="transformer layers of MiniLM kept")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=24, help="max tokens per sentence")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=1)
    ap.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="clip the gradient norm to this before the optimizer step (0: no clipping; note: "
        "smartckpt reads the gradients in the optimizer pre-hook, after clipping)",
    )
    ap.add_argument("--spikes", default="150,275,400", help="loop steps where the lr is multiplied")
    ap.add_argument("--spike-factor", type=float, default=400.0)
    ap.add_argument("--spike-len", type=int, default=1, help="optimizer steps per perturbation")
    ap.add_argument("--spike-shape", choices=("jolt", "ramp"), default="jolt")
    ap.add_argument("--mtbf", type=float, default=300.0, help="x step time")
    ap.add_argument("--save-cost", type=float, default=0.25, help="x step time")
    ap.add_argument("--save-total", type=float, default=2.0, help="x step time")
    ap.add_argument("--min-interval", type=float, default=3.0, help="x step time")
    ap.add_argument("--max-interval", type=float, default=60.0, help="x step time")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--spike-k", type=float, default=6.0)
    ap.add_argument("--checkpoints", type=int, default=None, help="calibrate all policies to N")
    ap.add_argument("--workdir", default="/tmp/smartckpt-trigger-eval")
    ap.add_argument("--reuse", help="a workdir of an earlier run: simulate its traces, train nothing")
    _record.add_json_argument(ap, "trigger_eval")
    C.add_device_argument(ap, "where the model trains")
    args = ap.parse_args()
    args.dev = C.device_of(args, ap)
    rec = _record.start("trigger_eval", args.dev)
    torch.set_num_threads(args.threads)
    spikes = [int(s) for s in args.spikes.split(",") if s.strip()]
    work = Path(args.reuse or args.workdir)
    results: dict[str, Any] = {"config": vars(args)}
    if not args.reuse:
        work.mkdir(parents=True, exist_ok=True)
        for sub in ("clean", "spikes"):
            for f in (work / sub / "traces").glob("*.csv"):
                f.unlink()
        data = C.TextData(max_len=args.seq)
        n = sum(p.numel() for p in C.load_minilm(num_layers=args.layers).parameters())
        print(f"all-MiniLM-L6-v2, {args.layers} layers ({n / 1e6:.1f}M parameters), batch {args.batch}")
        results["clean_run"] = train(args, data, work / "clean", [])
        results["spike_run"] = train(args, data, work / "spikes", spikes)
    for name in ("clean", "spikes"):
        trace = read_trace(work / name)
        gaps = [b.time - a.time for a, b in zip(trace.rows, trace.rows[1:], strict=False)]
        step_s = statistics.median(gaps) / args.eval_every
        res = simulate(trace, sim_config(args, step_s, args.checkpoints))
        clean = clean_distances(res, trace.rows, spikes, args.keep_last) if name == "spikes" else None
        results[name] = {**res.to_json(), "step_s": step_s, "clean": clean}
        results[name]["verdict"] = report(name, res, step_s, clean)
        if name == "spikes":
            # Two more views of the spike trace: the rollback decided at the onset instead of
            # the event's end, and twice as many checkpoints.
            views = {
                "spikes, rollback at onset": replace(
                    sim_config(args, step_s, args.checkpoints), rollback="onset"
                ),
                f"spikes @ {2 * res.target} ckpts": sim_config(args, step_s, 2 * res.target),
            }
            for label, cfg in views.items():
                res2 = simulate(trace, cfg)
                clean2 = clean_distances(res2, trace.rows, spikes, args.keep_last)
                results[label] = {**res2.to_json(), "clean": clean2}
                results[label]["verdict"] = report(label, res2, step_s, clean2)
                if "onset" in label:
                    figures(rec, "onset", res2, None)
        figures(rec, name, res, clean)
    rec.details = results
    rec.write(args.json)
    print(f"wrote {args.json}")


def figures(rec: Any, name: str, res: SimResult, clean: dict[str, Any] | None) -> None:
    """The trace's figures: lost work and distances, adaptive against fixed."""
    fixed, adaptive = res.policy("fixed"), res.policy("adaptive")
    trace = {"clean": "plain trace", "spikes": "spike trace", "onset": "spike trace, rollback at the onset"}[
        name
    ]
    if name != "onset":
        rec.add(
            f"{name}.checkpoints",
            adaptive.checkpoints,
            "count",
            f"{trace}: checkpoints of each policy (calibrated)",
        )
        rec.add(
            f"{name}.lost_ratio",
            adaptive.mean_lost / fixed.mean_lost,
            "x",
            f"{trace}: expected lost work per failure, adaptive / fixed",
        )
    if res.onsets and adaptive.mean_distance:
        rec.add(
            f"{name}.distance_ratio",
            fixed.mean_distance / adaptive.mean_distance,
            "x",
            f"{trace}: mean distance from a loss spike's onset back to the checkpoint rolled back to, fixed / adaptive",
        )
        rec.add(f"{name}.onsets", len(res.onsets), "count", f"{trace}: loss events detected")
    if clean is not None and clean["detected"]:
        rec.add(
            f"{name}.clean_adaptive_s",
            statistics.fmean(clean["adaptive"]["distances"]),
            "s",
            f"{trace}: clean distance, adaptive (mean)",
        )
        rec.add(
            f"{name}.clean_fixed_s",
            statistics.fmean(clean["fixed"]["distances"]),
            "s",
            f"{trace}: clean distance, fixed (mean)",
        )
        rec.add(
            f"{name}.detected",
            len(clean["detected"]),
            "count",
            f"{trace}: perturbations followed by a detected loss event",
        )


if __name__ == "__main__":
    main()
