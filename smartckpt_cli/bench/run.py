"""``smartckpt bench``: smartckpt against the tools users would otherwise pick, in one run, on the
CPU or on a CUDA device (``--device``; CUDA when there is one).

Three parts, each reported as soon as it is done (``on_update``), so a bench cut short still
leaves the figures it has:

1. **First save.** A fresh manager is registered and restored, the model trains for ``every``
   seconds (5 at most; a run that saves every ``every`` seconds trains that long before its first
   save), then the first save goes through ``mgr.step()`` (the lazy path): what the loop waited.
2. **Throughput with a save every ``every`` seconds** for no checkpointing, ``torch.save``, DCP
   ``async_save`` and smartckpt, in rotated rounds (throughput.py): the figure users feel.
3. **One save at a time**, ``reps`` repetitions: every figure is the median over them, and the
   methods are interleaved within each repetition, in an order that rotates from one repetition
   to the next (A B C D, B C D A, ...), so that a noisy neighbour, or what the previous method
   left behind, hurts all of them alike. Anchors:

   * ``torch.save`` + fsync (the traditional baseline) and ``torch.load`` + ``load_state_dict``;
   * ``torch.distributed.checkpoint`` ``save``, ``load`` and ``async_save`` (blocking time: the
     call and what the next step's update waited for its staging copy; total time: until
     written), staging as in savers.py;
   * the machine's lower bounds: copying the state into preallocated buffers (pinned host memory
     on CUDA: the device-to-host bound), and a sequential write + fsync of as many bytes.

   smartckpt runs as in training, one manager for the whole bench (``keep_last=2``), and is
   measured on its eager path (``save()``: blocking time = the whole snapshot copy), its lazy path
   inside a real training step, the time until the journal commit, the bytes on disk and the
   restore time.

   Each save (smartckpt's eager and lazy, DCP's ``async_save``) is also followed by one training
   step, timed with it: a step with the save, against a step of the same model without one, is
   the loop wait as the training loop's clock sees it (``DERIVED`` in result.py), the same
   way for every tool. The library's own counter (``SaveHandle.loop_wait_seconds``) is kept too.

smartckpt trains its own model (its manager's optimizer hooks are on it); the other contenders
share a second model built the same way (model.py). No rich here: the CLI renders the
result (result.py). This module sets the bench up, runs part 1 and calls parts 2 and 3
(throughput.py, alone.py) in order, and re-exports the names the CLI and ``benchmarks/`` use.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.bench.alone import one_save_at_a_time
from smartckpt_cli.bench.context import BenchContext
from smartckpt_cli.bench.model import (
    DEFAULT_BATCH,
    DEFAULT_PARAMS,
    build_model,
    resolve_device,
    state_tensors,
    train_step,
)
from smartckpt_cli.bench.result import RATIOS, BenchResult
from smartckpt_cli.bench.savers import DcpSaver, Rotation
from smartckpt_cli.bench.throughput import Throughput, Trainer, run_throughput

__all__ = ["RATIOS", "BenchResult", "build_model", "resolve_device", "run_bench", "train_step"]

logger = logging.getLogger(__name__)


class _BenchPolicy:
    """Fires when the bench says so (``fire``), so every contender saves on the same schedule."""

    fire = False

    def should_save(self, ctx: Any) -> Any:
        from smartckpt_cli.trigger.context import Decision

        return Decision(self.fire, "bench")


def run_bench(
    params: int | None = None,
    *,
    device: str | None = None,
    reps: int = 3,
    batch: int | None = None,
    every: float = 10.0,
    rounds: int = 2,
    workdir: str | os.PathLike[str] | None = None,
    precision: str = "exact",
    compression_level: int = 1,
    workers: int = 0,
    progress: Callable[[str], None] = lambda _msg: None,
    on_update: Callable[[BenchResult], None] = lambda _result: None,
) -> BenchResult:
    dev = resolve_device(device)
    params = int(params or DEFAULT_PARAMS[dev.type])
    batch = batch or DEFAULT_BATCH[dev.type]
    cuda = dev.type == "cuda"
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    step_fn = functools.partial(train_step, batch=batch)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*process group.*")
    root = Path(tempfile.mkdtemp(prefix="smartckpt-bench-", dir=workdir))
    progress(f"building two {params / 1e6:.0f}M-parameter models with AdamW state on {dev}")
    smart = Trainer(*build_model(params, device=dev), step_fn=step_fn)
    plain = Trainer(*build_model(params, device=dev), step_fn=step_fn)
    result = _new_result(plain, reps, dev, batch, every)
    rotation = Rotation()
    dcp = DcpSaver(plain.model, plain.opt, dev)
    result.info["dcp_async_staging"] = dcp.staging
    policy = _BenchPolicy()
    try:
        with _manager(root, policy, precision, compression_level, workers) as mgr:
            mgr.register(model=smart.model, optimizer=smart.opt)
            mgr.restore()
            ctx = BenchContext(
                mgr, policy, smart, plain, dcp, rotation, root, sync, result, progress, on_update
            )
            _measure(ctx, every, rounds)
    finally:
        dcp.close()
        shutil.rmtree(root, ignore_errors=True)
    return result


def _manager(root: Path, policy: _BenchPolicy, precision: str, compression_level: int, workers: int) -> Any:
    """smartckpt's manager for the whole bench, saving when ``policy`` fires."""
    from smartckpt_cli.engine.manager import CheckpointManager

    return CheckpointManager(
        root / "smartckpt",
        precision=precision,
        compression_level=compression_level,
        workers=workers,
        keep_last=2,
        policy=policy,
        # A bench stopped by SIGTERM (a time limit) stops; no preemption checkpoint first.
        preempt_signals="",
    )


def _measure(ctx: BenchContext, every: float, rounds: int) -> None:
    """The three parts (module docstring), in order, with the manager registered and restored;
    ``result`` is handed to ``on_update`` after each."""
    # A run saving every `every` seconds takes its first save after as long; 5 s at
    # most here (the bench's time), still what a background preparation could use.
    first_after = min(every, 5.0)
    ctx.progress(f"first save, after {first_after:g} s of training")
    _first_save(ctx.mgr, ctx.policy, ctx.smart, first_after, ctx.sync, ctx.result)
    ctx.result.done.append("first-save")
    ctx.on_update(ctx.result)
    if rounds > 0:
        _throughput_part(ctx, every, rounds)
    else:
        ctx.result.notes.append("throughput part skipped (--rounds 0)")
    ctx.result.done.append("throughput")
    ctx.on_update(ctx.result)
    one_save_at_a_time(ctx)
    ctx.result.done.append("saves")
    ctx.on_update(ctx.result)


def _new_result(plain: Trainer, reps: int, dev: torch.device, batch: int, every: float) -> BenchResult:
    """An empty result for the model ``plain`` (the contenders' model), with what it ran on."""
    result = BenchResult(
        sum(p.numel() for p in plain.model.parameters()),
        sum(t.numel() * t.element_size() for t in state_tensors(plain.model, plain.opt)),
        reps,
        device=dev.type,
    )
    result.info = {
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": batch,
        "every_seconds": every,
    }
    return result


def _throughput_part(ctx: BenchContext, every: float, rounds: int) -> None:
    """Part 2 (module docstring), after the warm-ups that keep its first round from being the
    slow one."""
    plain, dcp, root, rotation, result = ctx.plain, ctx.dcp, ctx.root, ctx.rotation, ctx.result
    ctx.progress("warm-up save of DCP async_save (its staging buffers)")
    dcp.async_save(root / "dcp-async-warmup").wait()
    rotation.rotate("dcp-async", root / "dcp-async-warmup")
    # The other model trained for `every` seconds above; this one warms up too
    # (allocator, kernels), so the first block of round 1 is not the slow one.
    warm = time.perf_counter() + min(every, 2.0)
    while time.perf_counter() < warm:
        plain.step()
    ctx.sync()

    def round_done(tp: Throughput) -> None:
        result.throughput = tp
        ctx.on_update(result)

    tp = run_throughput(
        plain=plain,
        smart=ctx.smart,
        mgr=ctx.mgr,
        policy=ctx.policy,
        dcp=dcp,
        root=root,
        rotation=rotation,
        every=every,
        rounds=rounds,
        sync=ctx.sync,
        progress=ctx.progress,
        on_round=round_done,
    )
    result.later_lazy_waits.extend(tp.loop_wait.get("smartckpt", []))


def _first_save(
    mgr: Any,
    policy: _BenchPolicy,
    smart: Trainer,
    every: float,
    sync: Callable[[], None],
    result: BenchResult,
) -> None:
    end = time.perf_counter() + every
    while True:
        loss = smart.step()
        if time.perf_counter() >= end:
            break
        mgr.step(smart.steps, loss=loss)
    policy.fire = True
    t0 = time.perf_counter()
    res = mgr.step(smart.steps, loss=loss)
    call = time.perf_counter() - t0
    policy.fire = False
    smart.step()  # its optimizer pre-hook waits for the lazy copies
    assert res.handle is not None
    res.handle.wait()
    if res.handle.error is not None:
        raise res.handle.error
    result.add(
        "smartckpt.first_lazy_loop_wait", call + res.handle.loop_wait_seconds - res.handle.blocking_seconds
    )
    sync()
