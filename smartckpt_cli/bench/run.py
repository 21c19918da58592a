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
result (result.py). This module runs parts 1 and 3 and re-exports the names the CLI and
``benchmarks/`` use.
"""

from __future__ import annotations

import functools
import gc
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

from smartckpt_cli.bench.model import (
    DEFAULT_BATCH,
    DEFAULT_PARAMS,
    build_model,
    resolve_device,
    state_tensors,
    train_step,
)
from smartckpt_cli.bench.result import RATIOS, BenchResult
from smartckpt_cli.bench.savers import DcpSaver, Rotation, TorchSaver, dir_bytes
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
    from smartckpt_cli.engine.manager import CheckpointManager

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
    result = BenchResult(
        sum(p.numel() for p in plain.model.parameters()),
        sum(t.numel() * t.element_size() for t in state_tensors(plain.model, plain.opt)),
        reps,
        device=dev.type,
    )
    result.info = {
        "device_name": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "batch": batch,
        "every_seconds": every,
    }
    rotation = Rotation()
    dcp = DcpSaver(plain.model, plain.opt, dev)
    result.info["dcp_async_staging"] = dcp.staging
    policy = _BenchPolicy()
    try:
        with CheckpointManager(
            root / "smartckpt",
            precision=precision,
            compression_level=compression_level,
            workers=workers,
            keep_last=2,
            policy=policy,
            # A bench stopped by SIGTERM (a time limit) stops; no preemption checkpoint first.
            preempt_signals="",
        ) as mgr:
            mgr.register(model=smart.model, optimizer=smart.opt)
            mgr.restore()
            # A run saving every `every` seconds takes its first save after as long; 5 s at
            # most here (the bench's time), still what a background preparation could use.
            first_after = min(every, 5.0)
            progress(f"first save, after {first_after:g} s of training")
            _first_save(mgr, policy, smart, first_after, sync, result)
            result.done.append("first-save")
            on_update(result)
            if rounds > 0:
                progress("warm-up save of DCP async_save (its staging buffers)")
                dcp.async_save(root / "dcp-async-warmup").wait()
                rotation.rotate("dcp-async", root / "dcp-async-warmup")
                # The other model trained for `every` seconds above; this one warms up too
                # (allocator, kernels), so the first block of round 1 is not the slow one.
                warm = time.perf_counter() + min(every, 2.0)
                while time.perf_counter() < warm:
                    plain.step()
                sync()

                def round_done(tp: Throughput) -> None:
                    result.throughput = tp
                    on_update(result)

                tp = run_throughput(
                    plain=plain,
                    smart=smart,
                    mgr=mgr,
                    policy=policy,
                    dcp=dcp,
                    root=root,
                    rotation=rotation,
                    every=every,
                    rounds=rounds,
                    sync=sync,
                    progress=progress,
                    on_round=round_done,
                )
                result.later_lazy_waits.extend(tp.loop_wait.get("smartckpt", []))
            else:
                result.notes.append("throughput part skipped (--rounds 0)")
            result.done.append("throughput")
            on_update(result)
            _one_save_at_a_time(
                mgr, policy, smart, plain, dcp, rotation, root, sync, result, progress, on_update
            )
            result.done.append("saves")
            on_update(result)
    finally:
        dcp.close()
        shutil.rmtree(root, ignore_errors=True)
    return result


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


def _one_save_at_a_time(
    mgr: Any,
    policy: _BenchPolicy,
    smart: Trainer,
    plain: Trainer,
    dcp: DcpSaver,
    rotation: Rotation,
    root: Path,
    sync: Callable[[], None],
    result: BenchResult,
    progress: Callable[[str], None],
    on_update: Callable[[BenchResult], None],
) -> None:
    """Part 3 (module docstring): each method alone, median of ``result.reps`` repetitions."""
    cuda = next(plain.model.parameters()).is_cuda
    payload = bytearray(os.urandom(1 << 20)) * 16  # 16 MiB of incompressible bytes
    torch_saver = TorchSaver(plain.model, plain.opt)
    buffers: list[torch.Tensor] = []

    def bound_copy(rep: int) -> None:
        # Taken afresh: a load replaces the optimizer's state tensors.
        tensors = state_tensors(plain.model, plain.opt)
        if not buffers:  # allocated once, outside the timing, as any staging buffer is
            try:
                buffers.extend(torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors)
            except RuntimeError as err:  # pinning can fail (locked-memory limits); pageable then
                result.notes.append(f"copy bound into pageable memory: pinning failed ({err})")
                buffers.extend(torch.empty(t.shape, dtype=t.dtype) for t in tensors)
        sync()
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t, non_blocking=cuda)
        sync()
        result.add("bound.copy", time.perf_counter() - t0)

    def bound_write(rep: int) -> None:
        path = root / "seq.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = result.state_bytes
            while left > 0:
                n = min(left, len(payload))
                f.write(memoryview(payload)[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        result.add("bound.write+fsync", time.perf_counter() - t0)
        path.unlink()

    def torch_save_load(rep: int) -> None:
        path = root / f"torch-{rep}.pt"
        sync()
        result.add("torch.save+fsync", torch_saver.save(path))
        result.sizes["torch.save"] = path.stat().st_size
        result.add("torch.load+load_state_dict", torch_saver.load(path, sync))
        rotation.rotate("torch", path)

    def dcp_save_load(rep: int) -> None:
        path = root / f"dcp-{rep}"
        sync()
        result.add("dcp.save", dcp.save(path))
        result.sizes["dcp.save"] = dir_bytes(path)
        result.add("dcp.load", dcp.load(path, sync))
        rotation.rotate("dcp", path)

    def dcp_async(rep: int) -> None:
        path = root / f"dcp-async-{rep}"
        sync()
        t0 = time.perf_counter()
        plain.step()  # the reference: one step of this model without a save
        sync()
        result.add("train_step_plain", time.perf_counter() - t0)
        # Saved at a step boundary, then one training step, whose update waits for the staging
        # copy: what the loop waits, measured as for smartckpt's lazy save.
        t0 = time.perf_counter()
        pending = dcp.async_save(path)
        staged: list[float] = []
        plain.step(before_update=lambda: staged.append(pending.wait_staged()))
        sync()
        result.add("dcp.async_save.step_with_save", time.perf_counter() - t0)
        result.add("dcp.async_save.blocking", pending.call_seconds + sum(staged))
        pending.wait()
        result.add("dcp.async_save.total", time.perf_counter() - t0)
        rotation.rotate("dcp-async", path)

    def smartckpt(rep: int) -> None:
        # A training step changes every tensor, so the measured save shares nothing with the
        # previous one.
        smart.step()
        sync()
        # The eager path: save() copies everything before it returns; then one training step
        # (beside the background persist, as DCP's step runs beside its upload).
        t0 = time.perf_counter()
        handle = mgr.save(smart.steps)
        smart.step()
        sync()
        result.add("smartckpt.eager_step_with_save", time.perf_counter() - t0)
        info = handle.wait()
        if handle.error is not None:
            raise handle.error
        assert info is not None
        result.add("smartckpt.blocking", handle.blocking_seconds)
        # Until the commit line is durable: the copy, then the background persist up to the
        # commit point (retention, which runs after it, is no more timed than the others' deletes).
        result.add("smartckpt.committed", handle.blocking_seconds + info.seconds)
        result.sizes["smartckpt"] = info.bytes_new
        # The lazy path inside a training step: save at a step boundary (the step() call), then
        # one real forward/backward/optimizer step, whose pre-hook waits for the deferred copies.
        loss = smart.step()
        sync()
        policy.fire = True
        t1 = time.perf_counter()
        res = mgr.step(smart.steps, loss=loss)
        call = time.perf_counter() - t1
        policy.fire = False
        smart.step()
        sync()
        step_with_save = time.perf_counter() - t1
        assert res.handle is not None
        res.handle.wait()
        wait = call + res.handle.loop_wait_seconds - res.handle.blocking_seconds
        result.add("smartckpt.lazy_loop_wait", wait)
        result.later_lazy_waits.append(wait)
        t1 = time.perf_counter()
        smart.step()
        sync()
        result.add("train_step", time.perf_counter() - t1)
        result.add("train_step_with_lazy_save", step_with_save)
        t0 = time.perf_counter()
        mgr.restore()
        sync()
        result.add("smartckpt.restore", time.perf_counter() - t0)

    # DCP async_save's first save allocates its stager's buffers (pinned, on CUDA), a first-save
    # cost that part 2's warm-up paid already; without part 2 a warm-up pays it here. No other
    # warm-up is needed: a method's first save, with no previous checkpoint to rotate against,
    # writes into fresh page-cache pages just as a rotating save does (Rotation).
    if not rotation.has("dcp-async"):
        dcp.async_save(root / "dcp-async-warmup").wait()
        rotation.rotate("dcp-async", root / "dcp-async-warmup")
    for rep in range(result.reps):
        progress(f"one save at a time, repetition {rep + 1} of {result.reps}")
        bound_copy(rep)
        bound_write(rep)
        # The order of the contenders rotates from one repetition to the next: what ran just
        # before (a large delete, a background flush) moves the next one's time here.
        contenders = [torch_save_load, dcp_save_load, dcp_async, smartckpt]
        k = rep % len(contenders)
        for fn in contenders[k:] + contenders[:k]:
            fn(rep)
            gc.collect()
            on_update(result)  # a bench cut short keeps every contender measured so far
