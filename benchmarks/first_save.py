"""Is the first save as cheap as the others? (issue 20)

The bench model (``smartckpt bench``'s: an MLP of about ``--params`` parameters, AdamW) trains on
``--device`` under a ``CheckpointManager`` saving every ``--every`` steps through ``mgr.step``,
the lazy path a training loop takes. For each save: what the loop waited for it (the snapshot's
eager copies plus what the optimizer pre-hook waited for the deferred ones,
``SaveHandle.loop_wait_seconds``). The staging buffers are prepared in the background from the
first step (snapshot.py), so the first save should wait no longer than the others: the figure is
the first save's wait against the median of the later ones (target ≤ 2×).

    python benchmarks/first_save.py [--device cpu|cuda] [--params 1e8] [--every 8] [--saves 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/first_save.py` from a checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import smartckpt_cli as sc  # noqa: E402


def build(params: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """smartckpt_cli.ops.bench_model.build_model's MLP, made on ``device``."""
    width = min(4096, max(64, int((params / 4) ** 0.5)))
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--every", type=int, default=8, help="steps between saves (long enough for each to commit first)"
    )
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--workdir", default=None, help="where the store goes (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if args.saves < 2 or args.every < 1 or args.params < 1:
        ap.error("--saves must be at least 2, --every and --params positive")
    device = torch.device(args.device)
    model, opt = build(int(args.params), device)
    width = next(model.parameters()).shape[1]
    x = torch.randn(args.batch, width, device=device)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3  # + AdamW's 2 moments
    handles = []
    with tempfile.TemporaryDirectory(prefix="smartckpt-first-save-", dir=args.workdir) as tmp:
        mgr = sc.CheckpointManager(tmp, every_steps=args.every, keep_last=2)
        mgr.register(model=model, optimizer=opt)
        mgr.restore()
        t0 = time.perf_counter()
        step = 0
        while len(handles) < args.saves:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            res = mgr.step(step, loss=loss)
            if res.saved:  # not waited for here: the loop goes on as in training
                handles.append(res.handle)
        mgr.close()
        elapsed = time.perf_counter() - t0
        prepared = mgr._stager.prepared_seconds
    waits = [h.loop_wait_seconds for h in handles]
    later = statistics.median(waits[1:])
    result = {
        "device": args.device,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": state,
        "every_steps": args.every,
        "step_s": elapsed / step,
        "loop_wait_s": waits,
        "first_s": waits[0],
        "later_median_s": later,
        "first_over_later": waits[0] / later if later > 0 else float("inf"),
        "staging_prepared_in_s": prepared,
    }
    print(
        f"{result['params'] / 1e6:.1f}M parameters ({state / 1e9:.2f} GB of state), {args.device}, a save every "
        f"{args.every} steps of {result['step_s']:.3f} s; staging prepared in the background in {prepared:.2f} s"
    )
    print("loop wait per save: " + ", ".join(f"{w * 1e3:.1f} ms" for w in waits))
    print(
        f"first save {waits[0] * 1e3:.1f} ms, later saves median {later * 1e3:.1f} ms: "
        f"{result['first_over_later']:.2f}x (target <= 2x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
