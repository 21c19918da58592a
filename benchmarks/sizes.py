"""Bytes on disk: smartckpt checkpoints versus ``torch.save`` of the same state.

Three measurements:

1. a ~100M-parameter transformer LM (default init, a few AdamW steps on random tokens):
   one checkpoint per precision (exact, bf16, fp16) against ``torch.save({"model": ...,
   "optimizer": ...})``; targets exact <= 0.90x, bf16 <= 0.60x;
2. frozen dedup: the same architecture with ~90% of the parameters frozen (AdamW over the rest),
   saved twice with a training step between; what the second checkpoint adds, against the raw
   bytes of the trainable parameters and their optimizer state; target <= 1.05x;
3. the real all-MiniLM-L6-v2 weights after a few AdamW steps of a sentence-pair fine-tune on real text:
   the same ratios as 1 (the realistic figure).

Store bytes are a directory walk of blobs/ + manifests/ + journal.jsonl (file sizes), one store
per checkpoint, so the ratio includes the manifest and journal overhead.

    python benchmarks/sizes.py [--json out.json] [--skip-synthetic] [--skip-minilm]

Runtime about 2 minutes on two CPU cores, peak RSS about 3.2 GB, about 1.5 GB of temporary disk.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as C
import _record
import torch
from torch import nn

from smartckpt_cli import CheckpointManager

TARGETS = {"exact": 0.90, "bf16": 0.60}
_ORDER = {
    c: i
    for i, c in enumerate(
        f"{base}{emb}" for base in ("weights", "exp_avg", "exp_avg_sq") for emb in ("", " [emb]")
    )
}
DEDUP_TARGET = 1.05


class TinyLM(nn.Module):
    """A GPT-style decoder (pre-norm blocks, tied embeddings): ~98.5M parameters by default."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        for emb in (self.tok, self.pos):  # GPT-2 init; N(0, 1) would give logits in the hundreds
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.tok.weight.T


def lm_step(model: TinyLM, opt: torch.optim.Optimizer, args: argparse.Namespace, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    # drawn on the CPU (the same tokens on every device), then moved where the model is
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(args.dev)
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def save_one(
    state_owner: dict[str, Any], root: Path, precision: str, step: int, emb: frozenset[str]
) -> dict[str, Any]:
    """One checkpoint into a fresh store; returns its on-disk size and per-category breakdown."""
    if root.exists():
        shutil.rmtree(root)
    mgr = CheckpointManager(root, precision=precision)
    mgr.register(**state_owner)
    t0 = time.perf_counter()
    info = mgr.save(step, blocking=True).wait()
    secs = time.perf_counter() - t0
    mgr.close()
    if info is None:
        raise RuntimeError(f"save with precision={precision} failed: {mgr.failures}")
    out = {
        "bytes": C.store_bytes(root),
        "bytes_new": info.bytes_new,
        "bytes_raw": info.bytes_raw,
        "seconds": round(secs, 2),
        "breakdown": C.breakdown(C.manifest_of(root, info.manifest), emb),
    }
    shutil.rmtree(root)
    return out


def zero_fractions(opt: torch.optim.Optimizer) -> dict[str, float]:
    """Fraction of exactly-zero values per moment (rows of an embedding no batch touched yet
    have zero moments; they compress to nothing and flatter the ratio)."""
    out = {}
    for name in ("exp_avg", "exp_avg_sq"):
        ts = [st[name] for st in opt.state.values() if name in st]
        n = sum(t.numel() for t in ts)
        out[name] = sum(int((t == 0).sum()) for t in ts) / max(1, n)
    return out


def compare(
    label: str, model: nn.Module, opt: torch.optim.Optimizer, step: int, work: Path
) -> dict[str, Any]:
    ref = work / f"{label}-torch.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ref)
    torch_bytes = ref.stat().st_size
    ref.unlink()
    res: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "torch_save_bytes": torch_bytes,
        "raw_state_bytes": C.state_raw_bytes({"m": model.state_dict(), "o": opt.state_dict()["state"]}),
        "precisions": {},
        "zero_fraction": zero_fractions(opt),
    }
    emb = C.embedding_keys(model, opt)
    for prec in ("exact", "bf16", "fp16"):
        r = save_one({"model": model, "optimizer": opt}, work / f"{label}-{prec}", prec, step, emb)
        r["ratio"] = r["bytes"] / torch_bytes
        rest = [b for cat, b in r["breakdown"].items() if "[emb]" not in cat]
        r["ratio_without_embedding"] = sum(b["stored"] + b["patch"] for b in rest) / sum(
            b["raw"] for b in rest
        )
        res["precisions"][prec] = r
        print(f"  {label:<8} {prec:<6} {C.mib(r['bytes']):>12}  ratio {r['ratio']:.4f}")
    return res


# ---------------------------------------------------------------- 1. ~100M synthetic


def build_lm(args: argparse.Namespace, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq).to(args.dev)


def synthetic(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = build_lm(args, 0)
    n = sum(p.numel() for p in model.parameters())
    print(f"\n[1] TinyLM: {n / 1e6:.1f}M parameters, {args.steps} AdamW steps on random tokens")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    for s in range(args.steps):
        t0 = time.perf_counter()
        loss = lm_step(model, opt, args, s)
        print(f"  step {s + 1}: loss {loss:.4f} ({time.perf_counter() - t0:.1f}s)")
    out = compare("tinylm", model, opt, args.steps, work)
    del model, opt
    gc.collect()
    return out


# ---------------------------------------------------------------- 2. frozen dedup


def frozen(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = build_lm(args, 1)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    frozen_n = 0
    for p in params:  # freeze from the bottom (embeddings, first blocks) up to >= 90%
        if frozen_n >= args.frozen_fraction * total:
            break
        p.requires_grad_(False)
        frozen_n += p.numel()
    trainable = [p for p in params if p.requires_grad]
    print(
        f"\n[2] frozen dedup: {frozen_n / total:.1%} of {total / 1e6:.1f}M parameters frozen, "
        f"AdamW over {sum(p.numel() for p in trainable) / 1e6:.2f}M"
    )
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01)
    root = work / "frozen"
    mgr = CheckpointManager(root, precision="exact")
    mgr.register(model=model, optimizer=opt)
    lm_step(model, opt, args, 0)
    first = mgr.save(1, blocking=True).wait()
    disk1 = C.store_bytes(root)
    frozen_before = {k: v.clone() for k, v in model.state_dict().items()}
    lm_step(model, opt, args, 1)
    second = mgr.save(2, blocking=True).wait()
    disk2 = C.store_bytes(root)
    mgr.close()
    if first is None or second is None:
        raise RuntimeError(f"frozen-dedup save failed: {mgr.failures}")
    unchanged = sum(
        t.numel() * t.element_size()
        for k, t in model.state_dict().items()
        if torch.equal(t, frozen_before[k])
    )
    raw_trainable = sum(p.numel() * p.element_size() for p in trainable)
    raw_opt = C.state_raw_bytes(opt.state_dict()["state"])
    raw = raw_trainable + raw_opt
    shutil.rmtree(root)
    out = {
        "params": total,
        "frozen_params": frozen_n,
        "trainable_params": sum(p.numel() for p in trainable),
        "unchanged_state_bytes": unchanged,
        "raw_trainable_bytes": raw_trainable,
        "raw_optimizer_state_bytes": raw_opt,
        "raw_bytes": raw,
        "first_bytes_new": first.bytes_new,
        "second_bytes_new": second.bytes_new,
        "second_disk_delta": disk2 - disk1,
        "ratio_bytes_new": second.bytes_new / raw,
        "ratio_disk_delta": (disk2 - disk1) / raw,
        "first_disk": disk1,
    }
    print(
        f"  second checkpoint: bytes_new {C.mib(second.bytes_new)}, disk delta "
        f"{C.mib(disk2 - disk1)}, raw trainable+optimizer {C.mib(raw)}"
    )
    del model, opt
    gc.collect()
    return out


# ---------------------------------------------------------------- 3. all-MiniLM-L6-v2


def minilm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = C.load_minilm().to(args.dev)
    data = C.TextData(max_len=args.minilm_seq)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"\n[3] all-MiniLM-L6-v2 ({n / 1e6:.1f}M parameters): {args.minilm_steps} AdamW steps "
        f"of a sentence-pair fine-tune on {len(data.train_pairs)} real pairs"
    )
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.minilm_lr, weight_decay=0.01)
    for s in range(args.minilm_steps):
        loss = C.pair_loss(model, data.batch(s, seed=0, size=args.minilm_batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"  step {s + 1}: loss {loss.item():.4f}")
    out = compare("minilm", model, opt, args.minilm_steps, work)
    del model, opt
    gc.collect()
    return out


# ---------------------------------------------------------------- report


def report(results: dict[str, Any]) -> None:
    rows = []
    for label in ("tinylm", "minilm"):
        if label not in results:
            continue
        r = results[label]
        for prec, p in r["precisions"].items():
            target = TARGETS.get(prec)
            verdict = "-" if target is None else ("PASS" if p["ratio"] <= target else "MISS")
            rows.append(
                [
                    f"{label} ({r['params'] / 1e6:.1f}M)",
                    prec,
                    C.mib(r["torch_save_bytes"]),
                    C.mib(p["bytes"]),
                    round(p["ratio"], 4),
                    f"<= {target:.2f}" if target else "(info)",
                    verdict,
                    round(p["ratio_without_embedding"], 4),
                    p["seconds"],
                ]
            )
    if rows:
        head = ["model", "precision", "torch.save", "smartckpt", "ratio", "target", "", "no-emb*"]
        head.append("save s")
        print("\n" + C.table(head, rows, "Checkpoint size vs torch.save"))
        print(
            "  * no-emb: stored/raw bytes of every entry except the word-embedding table and its "
            "moments\n    (untouched rows have all-zero moments, which compress to nothing)"
        )

    rows = []
    for label in ("tinylm", "minilm"):
        if label not in results:
            continue
        for prec, p in results[label]["precisions"].items():
            for cat, b in sorted(p["breakdown"].items(), key=lambda kv: _ORDER.get(kv[0], 9)):
                rows.append(
                    [
                        label,
                        prec,
                        cat,
                        C.mib(b["raw"]),
                        C.mib(b["stored"]),
                        C.mib(b["patch"]),
                        round((b["stored"] + b["patch"]) / max(1, b["raw"]), 4),
                    ]
                )
    if rows:
        head = ["model", "precision", "entries", "raw", "stored", "patch", "(stored+patch)/raw"]
        print("\n" + C.table(head, rows, "Where the bytes go (from the manifests)"))
        for label in ("tinylm", "minilm"):
            if label in results:
                z = results[label]["zero_fraction"]
                print(
                    f"  {label}: exactly-zero moments (untouched embedding rows): "
                    f"exp_avg {z['exp_avg']:.1%}, exp_avg_sq {z['exp_avg_sq']:.1%}"
                )

    if "frozen" in results:
        f = results["frozen"]
        rows = [
            ["parameters (frozen / total)", f"{f['frozen_params']:,} / {f['params']:,}"],
            ["frozen fraction", f"{f['frozen_params'] / f['params']:.2%}"],
            ["raw trainable params", C.mib(f["raw_trainable_bytes"])],
            ["raw optimizer state", C.mib(f["raw_optimizer_state_bytes"])],
            ["raw trainable + optimizer (R)", C.mib(f["raw_bytes"])],
            ["1st checkpoint bytes_new", C.mib(f["first_bytes_new"])],
            ["2nd checkpoint bytes_new (CommitInfo)", C.mib(f["second_bytes_new"])],
            ["2nd checkpoint disk delta (dir walk)", C.mib(f["second_disk_delta"])],
            ["bytes_new / R", f"{f['ratio_bytes_new']:.4f}"],
            [
                "disk delta / R",
                f"{f['ratio_disk_delta']:.4f}  (target <= {DEDUP_TARGET}: "
                f"{'PASS' if f['ratio_disk_delta'] <= DEDUP_TARGET else 'MISS'})",
            ],
        ]
        print("\n" + C.table(["frozen dedup (exact)", "value"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    _record.add_json_argument(ap, "sizes")
    ap.add_argument("--workdir", help="where the stores go (default: a temporary directory)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--skip-synthetic", action="store_true", help="skip measurements 1 and 2")
    ap.add_argument("--skip-minilm", action="store_true", help="skip measurement 3")
    g = ap.add_argument_group("synthetic ~100M model")
    g.add_argument("--layers", type=int, default=13)
    g.add_argument("--d-model", type=int, default=768)
    g.add_argument("--heads", type=int, default=12)
    g.add_argument("--vocab", type=int, default=8192)
    g.add_argument("--seq", type=int, default=128)
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--steps", type=int, default=4)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--frozen-fraction", type=float, default=0.9)
    g = ap.add_argument_group("all-MiniLM-L6-v2")
    g.add_argument("--minilm-steps", type=int, default=5)
    g.add_argument("--minilm-batch", type=int, default=32)
    g.add_argument("--minilm-seq", type=int, default=32)
    g.add_argument("--minilm-lr", type=float, default=5e-5)
    C.add_device_argument(ap, "where the models train")
    args = ap.parse_args()
    args.dev = C.device_of(args, ap)
    rec = _record.start("sizes", args.dev)
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    results: dict[str, Any] = {"config": vars(args)}
    with tempfile.TemporaryDirectory(prefix="smartckpt-sizes-", dir=args.workdir) as tmp:
        work = Path(tmp)
        if not args.skip_synthetic:
            results["tinylm"] = synthetic(args, work)
            results["frozen"] = frozen(args, work)
        if not args.skip_minilm:
            try:
                C.minilm_dir()
            except (ImportError, FileNotFoundError) as err:
                print(f"\n[3] skipped: all-MiniLM-L6-v2 not available ({err})")
            else:
                results["minilm"] = minilm(args, work)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    report(results)
    print(f"\ntotal {results['seconds']} s, peak RSS {results['peak_rss_mib']:,} MiB")
    for label, what in (("tinylm", "decoder LM"), ("minilm", "all-MiniLM-L6-v2")):
        if label not in results:
            continue
        r = results[label]
        rec.add(f"{label}.params", r["params"], "count", f"{what}: parameters")
        for prec, q in r["precisions"].items():
            rec.add(
                f"{label}.{prec}.ratio",
                q["ratio"],
                "x",
                f"{what}, precision {prec}: bytes on disk / torch.save's",
            )
            rec.add(
                f"{label}.{prec}.ratio_without_embedding",
                q["ratio_without_embedding"],
                "x",
                f"{what}, precision {prec}: stored / raw bytes without the word-embedding table",
            )
    if "frozen" in results:
        f = results["frozen"]
        rec.add("frozen.fraction_pct", 100 * f["frozen_params"] / f["params"], "%", "frozen parameters")
        rec.add(
            "frozen.ratio",
            f["ratio_disk_delta"],
            "x",
            "second checkpoint's disk delta / raw trainable parameters and their AdamW state",
        )
    rec.details = results
    rec.write(args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
