"""``smartckpt bench``: smartckpt against the tools users would otherwise pick, in one run.

Every figure is the median of ``reps`` repetitions, and the methods are interleaved within each
repetition, in an order that rotates from one repetition to the next (A B C D, B C D A, ...), so
that a noisy neighbour, or what the previous method left behind, hurts all of them alike. Anchors:

* ``torch.save`` + fsync (the traditional baseline) and ``torch.load`` + ``load_state_dict``;
* ``torch.distributed.checkpoint.save`` and ``async_save`` (blocking time and total time);
* the machine's lower bounds: copying the state into preallocated buffers, and a sequential
  write + fsync of the same number of bytes.

smartckpt runs as in training, one manager for the whole bench (``keep_last=2``), and is measured
on its eager path (``save()``: blocking time = the whole snapshot copy), its lazy path inside a
real training step (what the loop actually waits), the time until the journal commit, the bytes
on disk and the restore time. No rich here: the CLI renders the result.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["BenchResult", "build_model", "run_bench"]

logger = logging.getLogger(__name__)


def build_model(params: int, *, width: int = 4096) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of about ``params`` parameters with AdamW state after one real step."""
    width = min(width, max(64, int((params / 4) ** 0.5)))
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _train_step(model, opt)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int = 8) -> None:
    width = next(model.parameters()).shape[1]
    model(torch.randn(batch, width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class BenchResult:
    params: int
    state_bytes: int
    reps: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def median(self, name: str) -> float | None:
        vals = self.samples.get(name)
        return statistics.median(vals) if vals else None

    def ratio(self, a: str, b: str) -> float | None:
        x, y = self.median(a), self.median(b)
        return None if x is None or not y else x / y

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "state_bytes": self.state_bytes,
            "reps": self.reps,
            "median_seconds": {k: self.median(k) for k in self.samples},
            "samples": self.samples,
            "bytes_on_disk": self.sizes,
            "ratios": {name: self.ratio(a, b) for name, (a, b) in RATIOS.items()},
            "notes": self.notes,
        }


# name -> (numerator, denominator): the figures the targets are stated in.
RATIOS: dict[str, tuple[str, str]] = {
    "blocking / torch.save+fsync": ("smartckpt.blocking", "torch.save+fsync"),
    "blocking / DCP async_save blocking": ("smartckpt.blocking", "dcp.async_save.blocking"),
    "blocking / copy lower bound": ("smartckpt.blocking", "bound.copy"),
    "lazy loop wait / copy lower bound": ("smartckpt.lazy_loop_wait", "bound.copy"),
    "committed / torch.save+fsync": ("smartckpt.committed", "torch.save+fsync"),
    "committed / DCP save": ("smartckpt.committed", "dcp.save"),
    "committed / write lower bound": ("smartckpt.committed", "bound.write+fsync"),
    "restore / torch.load+load_state_dict": ("smartckpt.restore", "torch.load+load_state_dict"),
}


def run_bench(
    params: int = 100_000_000,
    *,
    reps: int = 3,
    workdir: str | os.PathLike[str] | None = None,
    precision: str = "exact",
    compression_level: int = 1,
    workers: int = 0,
    progress: Callable[[str], None] = lambda _msg: None,
) -> BenchResult:
    import torch.distributed.checkpoint as dcp

    from smartckpt_cli.manager import CheckpointManager
    from smartckpt_cli.trigger import Decision, TriggerContext

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    root = Path(tempfile.mkdtemp(prefix="smartckpt-bench-", dir=workdir))
    progress(f"building a {params / 1e6:.0f}M-parameter model with AdamW state")
    model, opt = build_model(params)
    tensors = [*model.state_dict().values()] + [
        t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    result = BenchResult(sum(p.numel() for p in model.parameters()), state_bytes, reps)
    buffers = [torch.empty_like(t) for t in tensors]
    payload = bytearray(os.urandom(1 << 20)) * 16  # 16 MiB of incompressible bytes

    class _Always:  # fires at every step: the bench decides when to call step()
        def should_save(self, ctx: TriggerContext) -> Decision:
            return Decision(True, "bench")

    def bound_copy() -> None:
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t)
        result.add("bound.copy", time.perf_counter() - t0)

    def bound_write() -> None:
        path = root / "seq.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = state_bytes
            while left > 0:
                n = min(left, len(payload))
                f.write(memoryview(payload)[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        result.add("bound.write+fsync", time.perf_counter() - t0)
        path.unlink()

    # Every contender rotates, as a careful user does: the new checkpoint is written while the
    # previous one still exists, and the previous one is deleted only afterwards (smartckpt's store
    # holds its earlier save too). Deleting first would let the new file reuse the page-cache pages
    # just freed, which on a virtual machine writes several times faster than fresh pages
    # (measured here: 2.8-3.1 GB/s into recycled pages, 0.3-0.4 GB/s into new ones) and would
    # compare a checkpoint-less moment against a safe save.
    previous: dict[str, Path] = {}

    def rotate(name: str, path: Path) -> None:
        old = previous.get(name)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        previous[name] = path

    def torch_save(path: Path) -> float:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def torch_save_load(rep: int) -> None:
        path = root / f"torch-{rep}.pt"
        result.add("torch.save+fsync", torch_save(path))
        result.sizes["torch.save"] = path.stat().st_size
        t0 = time.perf_counter()
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        result.add("torch.load+load_state_dict", time.perf_counter() - t0)
        del sd
        rotate("torch", path)

    def dcp_state() -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optimizer": osd}

    def dcp_save(rep: int) -> None:
        path = root / f"dcp-{rep}"
        t0 = time.perf_counter()
        dcp.save(dcp_state(), checkpoint_id=str(path))
        result.add("dcp.save", time.perf_counter() - t0)
        result.sizes["dcp.save"] = _dir_bytes(path)
        rotate("dcp", path)

    def dcp_async(rep: int) -> None:
        path = root / f"dcp-async-{rep}"
        t0 = time.perf_counter()
        fut: Any = dcp.async_save(dcp_state(), checkpoint_id=str(path))
        result.add("dcp.async_save.blocking", time.perf_counter() - t0)
        fut.result()
        result.add("dcp.async_save.total", time.perf_counter() - t0)
        rotate("dcp-async", path)

    def smartckpt(rep: int) -> None:  # mgr: the bench's one manager, made below
        step = 10 * (rep + 1)
        # A training step changes every tensor, so the measured save shares nothing with the
        # previous one.
        _train_step(model, opt)
        handle = mgr.save(step)
        info = handle.wait()
        if handle.error is not None:
            raise handle.error
        assert info is not None
        result.add("smartckpt.blocking", handle.blocking_seconds)
        # Until the commit line is durable: the copy, then the background persist up to the
        # commit point (retention, which runs after it, is no more timed than the others' deletes).
        result.add("smartckpt.committed", handle.blocking_seconds + info.seconds)
        result.sizes["smartckpt"] = info.bytes_new
        # The lazy path inside a training step: save at a step boundary, then one real
        # forward/backward/optimizer step, whose pre-hook waits for the deferred copies.
        t1 = time.perf_counter()
        res = mgr.step(step + 1)
        _train_step(model, opt)
        step_with_save = time.perf_counter() - t1
        assert res.handle is not None
        result.add("smartckpt.lazy_loop_wait", res.handle.loop_wait_seconds)
        res.handle.wait()
        t1 = time.perf_counter()
        _train_step(model, opt)
        result.add("train_step", time.perf_counter() - t1)
        result.add("train_step_with_lazy_save", step_with_save)
        t0 = time.perf_counter()
        mgr.restore()
        result.add("smartckpt.restore", time.perf_counter() - t0)

    try:
        # The previous checkpoint each contender's first measured save rotates against (see rotate).
        first = root / "torch-warmup.pt"
        torch_save(first)
        rotate("torch", first)
        for name in ("dcp", "dcp-async"):
            dcp.save(dcp_state(), checkpoint_id=str(root / f"{name}-warmup"))
            rotate(name, root / f"{name}-warmup")
        # smartckpt runs as in training: one manager for the whole bench (staging buffers and
        # thread pools made once, by the warm-up save), keep_last=2, so each save is written while
        # the previous one exists and retention then removes the older one: the same rotation as
        # the other contenders. A fresh manager per repetition would charge every measured save
        # with a newly allocated 1.2 GB of staging memory right before it, a first-save cost.
        with CheckpointManager(
            root / "smartckpt",
            precision=precision,
            compression_level=compression_level,
            workers=workers,
            keep_last=2,
            policy=_Always(),
        ) as mgr:
            mgr.register(model=model, optimizer=opt)
            mgr.save(0, blocking=True)
            for rep in range(reps):
                progress(f"repetition {rep + 1} of {reps}")
                bound_copy()
                bound_write()
                # The order of the contenders rotates from one repetition to the next: what ran
                # just before (a large delete, a background flush) moves the next one's time here.
                contenders = [torch_save_load, dcp_save, dcp_async, smartckpt]
                k = rep % len(contenders)
                for fn in contenders[k:] + contenders[:k]:
                    fn(rep)
                    gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result
