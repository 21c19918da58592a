"""Reduced-precision optimizer moments on a real fine-tune: what they lose, and whether it matters.

all-MiniLM-L6-v2 (real pretrained weights, offline) is fine-tuned with AdamW on real text
(sentence/next-sentence pairs from the standard library's docstrings, MultipleNegativesRanking
loss, the loss the model was trained with) for K steps, then checkpointed at K with each precision
(exact, bf16, fp16).

(a) Round trip. Each checkpoint is restored into a fresh model/optimizer through
    CheckpointManager; per moment (exp_avg, exp_avg_sq) we count values that are nonzero in the
    original but 0 after the round trip, and finite ones that became inf (target: 0 for both),
    and the largest relative error. For comparison: what a plain ``.half()`` / ``.bfloat16()``
    cast of the same tensors does.

(b) Resume quality. From each checkpoint, N more steps (same data, same dropout RNG: smartckpt
    restores it). The bf16/fp16 runs are compared with the exact one, and so are three runs
    that differ from the exact one only by noise a user gets anyway:

    - threads:  the continuation with a different number of intra-op threads; reductions are
                split differently, so gradients differ in the last bits (the CPU analogue of
                nondeterministic GPU kernels; the smallest perturbation a real run sees);
    - dropout:  the torch RNG reseeded after the restore: other dropout masks, same batches;
    - data:     another data-order seed for the continuation: other batches (seed-to-seed
                variance, the largest of the three).

    Per run: train loss at K+N, mean |loss difference| along the trace, a held-out eval loss
    (fixed batch, eval mode) at K+N, and the distance of the final weights from the exact run's,
    relative to how far the exact run moved them in those N steps.

A further run, the uninterrupted continuation of the original process, must equal the exact
resume bit for bit (smartckpt's invariant 1).

    python benchmarks/precision.py [--steps 100] [--continue-steps 100] [--json out.json]

Runtime: 800 training steps in all (K + 7 x N with the defaults); about 10 minutes on two idle
CPU cores (0.6-1.2 s per step), peak RSS about 3 GB. ``--skip-resume`` does part (a) only.
"""

from __future__ import annotations

import argparse
import gc
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as C
import _record
import torch

from smartckpt_cli import CheckpointManager

MOMENTS = ("exp_avg", "exp_avg_sq")
PRECISIONS = ("exact", "bf16", "fp16")


# ---------------------------------------------------------------- training


class Run:
    """A model, its AdamW, a warmup + linear-decay schedule."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model = C.load_minilm().to(args.dev)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        total = args.steps + args.continue_steps
        warm = max(1, total // 10)

        def schedule(i: int) -> float:
            return (i + 1) / warm if i < warm else 1.0 - 0.9 * (i - warm) / max(1, total - warm)

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt, "scheduler": self.sched}

    def train(
        self, data: C.TextData, start: int, n: int, *, seed: int, batch: int, log: str = ""
    ) -> list[float]:
        losses = []
        t0 = time.perf_counter()
        for step in range(start, start + n):
            loss = C.pair_loss(self.model, data.batch(step, seed, batch))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if log and (step + 1) % 25 == 0:
                print(
                    f"  {log}: step {step + 1} loss {losses[-1]:.4f} "
                    f"({(time.perf_counter() - t0) / len(losses):.2f} s/step)",
                    flush=True,
                )
        return losses

    @torch.no_grad()
    def eval_loss(self, data: C.TextData) -> float:
        self.model.eval()
        try:
            return float(C.pair_loss(self.model, data.eval_batch()))
        finally:
            self.model.train()

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).cpu()

    def moments(self) -> dict[str, list[torch.Tensor]]:
        sd = self.opt.state_dict()["state"]
        # on the host: compared there, and the GPU keeps only the live run's state
        return {m: [sd[i][m].detach().cpu().clone() for i in sorted(sd)] for m in MOMENTS}


# ---------------------------------------------------------------- (a) round trip


def lost(orig: list[torch.Tensor], back: list[torch.Tensor]) -> dict[str, Any]:
    """How ``back`` differs from ``orig``: nonzero->0, finite->inf, largest relative error."""
    nz = to_zero = to_inf = 0
    max_rel = 0.0
    for o, b in zip(orig, back, strict=True):
        o, b = o.float(), b.float()
        nonzero = o != 0
        nz += int(nonzero.sum())
        to_zero += int((nonzero & (b == 0)).sum())
        to_inf += int((torch.isfinite(o) & torch.isinf(b)).sum())
        ok = nonzero & torch.isfinite(b)
        if bool(ok.any()):
            max_rel = max(max_rel, float(((b[ok] - o[ok]).abs() / o[ok].abs()).max()))
    return {"nonzero": nz, "to_zero": to_zero, "to_inf": to_inf, "max_rel_err": max_rel}


def patched(manifest: dict[str, Any], moment: str) -> tuple[int, str]:
    """Values kept exactly in the patch for ``moment``, and the transform used."""
    n, kinds = 0, set()
    for key, entry in manifest["entries"].items():
        if key.startswith("optimizer/state/") and key.endswith(f"/{moment}"):
            kinds.add(entry["transform"]["kind"])
            n += int(entry["patch"]["n"]) if entry.get("patch") else 0
    return n, "+".join(sorted(kinds))


# ---------------------------------------------------------------- (b) resume runs


def resume(
    args: argparse.Namespace,
    data: C.TextData,
    store: Path,
    label: str,
    *,
    threads: int | None = None,
    reseed: int | None = None,
    data_seed: int = 0,
) -> tuple[Run, dict[str, Any]]:
    run = Run(args)
    mgr = CheckpointManager(store)
    mgr.register(**run.objects())
    step = mgr.restore()
    manifest = mgr.last_restore or {}
    mgr.close()
    if step != args.steps:
        raise RuntimeError(f"{label}: restored step {step}, expected {args.steps}")
    restored = run.moments()  # exactly what the restore put into the fresh optimizer
    if reseed is not None:
        torch.manual_seed(reseed)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        losses = run.train(data, args.steps, args.continue_steps, seed=data_seed, batch=args.batch, log=label)
    finally:
        torch.set_num_threads(before)
    out = {
        "losses": losses,
        "eval": run.eval_loss(data),
        "params": run.params(),
        "seconds": round(time.perf_counter() - t0, 1),
        "manifest": manifest,
        "moments": restored,
    }
    return run, out


def compare_runs(ref: dict[str, Any], run: dict[str, Any], theta_k: torch.Tensor) -> dict[str, Any]:
    la, lb = torch.tensor(ref["losses"]), torch.tensor(run["losses"])
    moved = float((ref["params"] - theta_k).norm())
    tail = min(20, len(la))
    return {
        "final_loss": float(lb[-1]),
        "final_loss_diff": float((lb[-1] - la[-1]).abs()),
        "trace_mean_abs_diff": float((lb - la).abs().mean()),
        "trace_max_abs_diff": float((lb - la).abs().max()),
        "last20_mean_diff": float((lb[-tail:].mean() - la[-tail:].mean()).abs()),
        "eval_loss": run["eval"],
        "eval_diff": abs(run["eval"] - ref["eval"]),
        "param_dist_rel": float((run["params"] - ref["params"]).norm()) / moved,
        "first_diverging_step": next(
            (i for i, (x, y) in enumerate(zip(ref["losses"], run["losses"], strict=True)) if x != y),
            None,
        ),
        "bit_identical": run["losses"] == ref["losses"] and torch.equal(run["params"], ref["params"]),
    }


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=100, help="K: steps before the checkpoint")
    ap.add_argument("--continue-steps", type=int, default=100, help="N: steps after the resume")
    ap.add_argument("--batch", type=int, default=16, help="sentence pairs per step")
    ap.add_argument("--seq", type=int, default=32, help="max tokens per sentence")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the main runs")
    ap.add_argument("--noise-threads", type=int, default=1, help="threads of the 'threads' run")
    ap.add_argument("--skip-resume", action="store_true", help="only part (a)")
    ap.add_argument("--skip-uninterrupted", action="store_true", help="no invariant-1 check run")
    ap.add_argument("--workdir", help="where the stores go (default: a temporary directory)")
    _record.add_json_argument(ap, "precision")
    C.add_device_argument(ap, "where the model trains")
    args = ap.parse_args()
    args.dev = C.device_of(args, ap)
    rec = _record.start("precision", args.dev)
    try:
        C.minilm_dir()
    except (ImportError, FileNotFoundError) as err:
        raise SystemExit(f"all-MiniLM-L6-v2 is not available: {err}") from None
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    results: dict[str, Any] = {"config": vars(args)}

    data = C.TextData(max_len=args.seq)
    torch.manual_seed(0)
    base = Run(args)
    n = sum(p.numel() for p in base.model.parameters())
    print(
        f"all-MiniLM-L6-v2 ({n / 1e6:.1f}M parameters), {len(data.train_pairs)} training pairs; "
        f"{args.steps} AdamW steps, batch {args.batch}, {args.threads} threads"
    )
    base_losses = base.train(data, 0, args.steps, seed=0, batch=args.batch, log="train")
    results["train_losses"] = base_losses

    with tempfile.TemporaryDirectory(prefix="smartckpt-precision-", dir=args.workdir) as tmp:
        stores = {p: Path(tmp) / p for p in PRECISIONS}
        saved = {}
        for prec, root in stores.items():
            mgr = CheckpointManager(root, precision=prec)
            mgr.register(**base.objects())
            info = mgr.save(args.steps, blocking=True).wait()
            mgr.close()
            if info is None:
                raise RuntimeError(f"save with precision {prec} failed: {mgr.failures}")
            saved[prec] = {"bytes": C.store_bytes(root), "bytes_raw": info.bytes_raw}
        results["checkpoint_bytes"] = saved
        orig = base.moments()
        theta_k = base.params()
        eval_k = base.eval_loss(data)

        uninterrupted = None
        if not args.skip_resume and not args.skip_uninterrupted:
            losses = base.train(
                data, args.steps, args.continue_steps, seed=0, batch=args.batch, log="uninterrupted"
            )
            uninterrupted = {"losses": losses, "eval": base.eval_loss(data), "params": base.params()}
        del base
        gc.collect()

        # (a) round trip, and (b) the resumed runs of each precision
        roundtrip: dict[str, Any] = {}
        runs: dict[str, dict[str, Any]] = {}
        for prec in PRECISIONS:
            if args.skip_resume:
                back, manifest = restore_only(args, stores[prec])
            else:
                run, runs[prec] = resume(args, data, stores[prec], prec)
                manifest, back = runs[prec].pop("manifest"), runs[prec].pop("moments")
                del run
            roundtrip[prec] = {}
            for m in MOMENTS:
                r = lost(orig[m], back[m])
                r["patched"], r["transform"] = patched(manifest, m)
                roundtrip[prec][m] = r
            del back
            gc.collect()
        for cast, dtype in (("plain .half()", torch.float16), ("plain .bfloat16()", torch.bfloat16)):
            roundtrip[cast] = {m: lost(orig[m], [t.to(dtype) for t in orig[m]]) for m in MOMENTS}
        results["roundtrip"] = roundtrip

        if not args.skip_resume:
            noise = {
                f"noise: threads {args.threads}->{args.noise_threads}": {"threads": args.noise_threads},
                "noise: dropout reseed": {"reseed": 12345},
                "noise: data order": {"data_seed": 1},
            }
            for label, kw in noise.items():
                run, runs[label] = resume(args, data, stores["exact"], label, **kw)
                runs[label].pop("manifest")
                runs[label].pop("moments")
                del run
                gc.collect()
            ref = runs["exact"]
            results["eval_loss_at_K"] = eval_k
            results["exact_eval_improvement"] = eval_k - ref["eval"]
            results["resume"] = {
                label: compare_runs(ref, r, theta_k) for label, r in runs.items() if label != "exact"
            }
            results["resume"]["exact"] = compare_runs(ref, ref, theta_k)
            if uninterrupted is not None:
                results["uninterrupted_vs_exact_resume"] = compare_runs(ref, uninterrupted, theta_k)
            results["traces"] = {label: r["losses"] for label, r in runs.items()}

    results["seconds"] = round(time.perf_counter() - t_start, 1)
    results["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    report(args, results)
    for label, per in results["roundtrip"].items():
        for m in MOMENTS:
            r = per[m]
            what = f"round trip, {label}, {m}"
            rec.add(f"roundtrip.{label}.{m}.nonzero", r["nonzero"], "count", f"{what}: nonzero values before")
            rec.add(
                f"roundtrip.{label}.{m}.to_zero",
                r["to_zero"],
                "count",
                f"{what}: nonzero values that became 0",
            )
            rec.add(
                f"roundtrip.{label}.{m}.to_inf",
                r["to_inf"],
                "count",
                f"{what}: finite values that became inf",
            )
            rec.add(
                f"roundtrip.{label}.{m}.max_rel_err",
                r["max_rel_err"],
                "num",
                f"{what}: largest relative error",
            )
            if "patched" in r:
                rec.add(
                    f"roundtrip.{label}.{m}.patched",
                    r["patched"],
                    "count",
                    f"{what}: values kept exactly beside the tensor",
                )
    for label, r in results.get("resume", {}).items():
        what = f"resume from {label} vs the exact resume, {args.continue_steps} steps later"
        rec.add(
            f"resume.{label}.final_loss_diff",
            r["final_loss_diff"],
            "num",
            f"{what}: |loss difference| at the last step",
        )
        rec.add(f"resume.{label}.eval_diff", r["eval_diff"], "num", f"{what}: |held-out loss difference|")
    rec.details = results
    rec.write(args.json)
    print(f"wrote {args.json}")


def restore_only(
    args: argparse.Namespace, store: Path
) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
    """The moments exactly as a restore puts them into a fresh optimizer, and the manifest."""
    run = Run(args)
    mgr = CheckpointManager(store)
    mgr.register(**run.objects())
    mgr.restore()
    mgr.close()
    return run.moments(), mgr.last_restore or {}


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    rows = []
    for label, per in results["roundtrip"].items():
        for m in MOMENTS:
            r = per[m]
            rows.append(
                [
                    label,
                    m,
                    r.get("transform", "-"),
                    f"{r['nonzero']:,}",
                    f"{r['to_zero']:,} ({r['to_zero'] / max(1, r['nonzero']):.2%})",
                    f"{r['to_inf']:,}",
                    r["max_rel_err"],
                    f"{r['patched']:,}" if "patched" in r else "-",
                ]
            )
    head = ["precision", "moment", "transform", "nonzero", "nonzero->0", "->inf", "max rel err"]
    head.append("patched")
    print(
        "\n"
        + C.table(
            head,
            rows,
            f"(a) Round trip of real AdamW moments after {args.steps} steps "
            "(target: nonzero->0 = 0, ->inf = 0)",
        )
    )
    sizes = results["checkpoint_bytes"]
    print(
        "  checkpoint bytes: "
        + ", ".join(
            f"{p} {C.mib(s['bytes'])} ({s['bytes'] / sizes['exact']['bytes']:.3f}x exact)"
            for p, s in sizes.items()
        )
    )
    if "resume" not in results:
        return
    rows = []
    for label, r in results["resume"].items():
        rows.append(
            [
                label,
                r["final_loss"],
                r["final_loss_diff"],
                r["trace_mean_abs_diff"],
                r["last20_mean_diff"],
                r["eval_loss"],
                r["eval_diff"],
                r["param_dist_rel"],
                "-" if r["first_diverging_step"] is None else r["first_diverging_step"] + 1,
            ]
        )
    k, n = args.steps, args.continue_steps
    head = [
        "run (vs exact resume)",
        f"loss@{k + n}",
        "|diff|",
        "mean|diff| trace",
        "|diff| last-20 mean",
        f"eval@{k + n}",
        "|eval diff|",
        "param dist (rel)",
        "diverges at",
    ]
    print("\n" + C.table(head, rows, f"(b) Resume quality: checkpoint at step {k}, {n} more steps"))
    print(
        f"  eval loss at step {k}: {results['eval_loss_at_K']:.4f}; exact run at step {k + n}: "
        f"{results['resume']['exact']['eval_loss']:.4f}.\n"
        "  param dist (rel) = ||theta_run - theta_exact|| / ||theta_exact - theta_K|| at the end.\n"
        "  'diverges at' = first continuation step (1-based) whose loss differs from the exact run."
    )
    u = results.get("uninterrupted_vs_exact_resume")
    if u is not None:
        verdict = "bit-identical" if u["bit_identical"] else "DIFFERENT (invariant 1 broken!)"
        print(f"  uninterrupted run vs exact resume: {verdict}")
    print(f"\ntotal {results['seconds']} s, peak RSS {results['peak_rss_mib']:,} MiB")


if __name__ == "__main__":
    main()
