"""Is the first save as cheap as the others?

The bench model (``smartckpt bench``'s: an MLP of about ``--params`` parameters, AdamW) trains on
``--device`` under a ``CheckpointManager`` saving every ``--every`` steps through ``mgr.step``,
the lazy path a training loop takes. For each save, what the loop waited for it, two ways:

* from the loop's clock: the step that took the save and the next one (whose optimizer update
  waits for the lazy copies), each against the median step without a save in flight
  (benchmarks/_loop.py);
* the library's own counter, ``SaveHandle.loop_wait_seconds`` (the snapshot's eager copies plus
  what the optimizer pre-hook waited for the deferred ones).

The staging buffers are prepared in the background from the first step (engine/snapshot.py), so
the first save should wait no longer than the others: the figure is the first save's wait against
the median of the later ones (target ≤ 2×). ``--no-prepare`` switches the preparation off (a
benchmark-only switch: the manager's ``_prepare`` flag cleared before the first step), so the
first save allocates and touches its staging memory itself: what the preparation saves.

``--ram`` puts the RAM tier on, as ``smartckpt run`` does (``SMARTCKPT_RAM_AREA``: a folder in
/dev/shm), with no RAM snapshots of its own (``ram_every`` 1e9): each save then copies into one
of the tier's two slot files, and the first save into each is the first to write its pages. The
slots are faulted in by the thread that prepares them (engine/ramtier.py), so the first two saves
should wait no longer than the later ones.

    python benchmarks/first_save.py [--device cpu|cuda] [--params 1e8] [--every 8] [--saves 6] [--no-prepare] [--ram]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/first_save.py` from a checkout
    sys.path.insert(0, str(ROOT))

import _loop  # noqa: E402
import _record  # noqa: E402
import torch  # noqa: E402

import smartckpt_cli as sc  # noqa: E402


def build(params: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """smartckpt_cli.bench.model.build_model's MLP, made on ``device``."""
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
    ap.add_argument("--no-prepare", action="store_true", help="no staging preparation in the background")
    ap.add_argument(
        "--ram", action="store_true", help="the RAM tier on (slots in /dev/shm), as under smartckpt run"
    )
    _record.add_json_argument(ap, "first_save")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if args.saves < 2 or args.every < 1 or args.params < 1:
        ap.error("--saves must be at least 2, --every and --params positive")
    device = torch.device(args.device)
    rec = _record.start("first_save", device)
    model, opt = build(int(args.params), device)
    width = next(model.parameters()).shape[1]
    x = torch.randn(args.batch, width, device=device)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3  # + AdamW's 2 moments
    handles: list[tuple[int, object]] = []
    done_at: dict[int, int] = {}  # save number -> index of the step after which it was committed
    times: list[float] = []
    area = None
    if args.ram:
        area = tempfile.mkdtemp(
            prefix="smartckpt-first-save-ram-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        os.environ["SMARTCKPT_RAM_AREA"] = area
    with tempfile.TemporaryDirectory(prefix="smartckpt-first-save-", dir=args.workdir) as tmp:
        mgr = sc.CheckpointManager(
            tmp, every_steps=args.every, keep_last=2, **({"ram_every": 1e9} if args.ram else {})
        )
        mgr.register(model=model, optimizer=opt)
        mgr.restore()
        if args.no_prepare:
            mgr._prepare = False  # benchmark-only: the first save prepares nothing in advance
        t0 = time.perf_counter()
        step = 0
        while len(handles) < args.saves or len(done_at) < len(handles):
            t1 = time.perf_counter()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            res = mgr.step(step, loss=loss)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t1)
            if res.saved and len(handles) < args.saves:  # not waited for: the loop goes on as in training
                handles.append((step - 1, res.handle))
            for i, (_, h) in enumerate(handles):
                if i not in done_at and h.done():  # type: ignore[attr-defined]
                    done_at[i] = step - 1
        mgr.close()
        elapsed = time.perf_counter() - t0
        prepared = mgr._stager.prepared_seconds
        in_ram = [getattr(h._snapshot, "ram_slot", None) for _, h in handles]  # type: ignore[attr-defined]
    if area is not None:
        shutil.rmtree(area, ignore_errors=True)
    windows = [_loop.SaveWindow(k, done_at[i]) for i, (k, _) in enumerate(handles)]
    costs = _loop.loop_costs([(times, windows)])
    waits = [c["loop_wait_s"] for c in costs["saves"]]
    library = [h.loop_wait_seconds for _, h in handles]  # type: ignore[attr-defined]
    later, later_lib = statistics.median(waits[1:]), statistics.median(library[1:])
    how = "staging not prepared (--no-prepare)" if args.no_prepare else "staging prepared in the background"
    if args.ram:
        how += (
            "; RAM tier on (saves into its slots: "
            + ", ".join("-" if s is None else str(s) for s in in_ram)
            + ")"
        )
        first_two = max(waits[:2]) / statistics.median(waits[2:]) if len(waits) > 2 else 0.0
        rec.add(
            "first_two_over_later", first_two, "x", f"{how}: the slower of the first two saves / later saves"
        )
    rec.add("first_ms", 1e3 * waits[0], "ms", f"{how}: loop wait of the first save, step-time difference")
    rec.add(
        "later_ms", 1e3 * later, "ms", f"{how}: loop wait of the later saves, step-time difference, median"
    )
    rec.add(
        "first_over_later",
        waits[0] / later if later > 0 else 0.0,
        "x",
        f"{how}: first / later (step-time difference)",
    )
    rec.add(
        "first_library_ms", 1e3 * library[0], "ms", f"{how}: the first save, SaveHandle.loop_wait_seconds"
    )
    rec.add(
        "later_library_ms", 1e3 * later_lib, "ms", f"{how}: later saves, SaveHandle.loop_wait_seconds, median"
    )
    rec.add(
        "first_over_later_library",
        library[0] / later_lib if later_lib > 0 else 0.0,
        "x",
        f"{how}: first / later (library's counter)",
    )
    rec.add("step_ms", 1e3 * costs["ref_step_s"], "ms", "median step without a save in flight")
    rec.add("state_gb", state / 1e9, "GB", "model and AdamW state")
    if not args.no_prepare:
        rec.add("prepared_s", prepared, "s", "staging prepared in the background in")
    rec.details.update(
        params=sum(p.numel() for p in model.parameters()),
        every_steps=args.every,
        prepare=not args.no_prepare,
        ram=args.ram,
        ram_slots=in_ram if args.ram else None,
        step_s=elapsed / step,
        loop_wait_s=waits,
        library_loop_wait_s=library,
        saves=costs["saves"],
    )
    rec.write(args.json)
    print(
        f"{rec.details['params'] / 1e6:.1f}M parameters ({state / 1e9:.2f} GB of state), {args.device}, a save every "
        f"{args.every} steps of {costs['ref_step_s']:.3f} s; {how}"
        + (f" in {prepared:.2f} s" if not args.no_prepare else "")
    )
    print("loop wait per save, step-time difference: " + ", ".join(f"{w * 1e3:.0f} ms" for w in waits))
    print("the library's counter:                    " + ", ".join(f"{w * 1e3:.0f} ms" for w in library))
    print(
        f"first save / later saves: {waits[0] / later:.2f}x (step-time difference), {library[0] / later_lib:.2f}x (counter)"
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
