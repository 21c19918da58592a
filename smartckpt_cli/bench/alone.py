"""Part 3 of ``smartckpt bench``: one save at a time (run.py's module docstring says what is
measured and why the contenders are interleaved and rotated).

A module of its own: part 3 is the longest part and shares nothing with part 2
(throughput.py) but the trainers, the savers and the result it adds to; run.py sets the bench
up and runs the parts in order.
"""

from __future__ import annotations

import gc
import os
import time

import torch

from smartckpt_cli.bench.context import BenchContext
from smartckpt_cli.bench.model import state_tensors
from smartckpt_cli.bench.savers import TorchSaver, dir_bytes

__all__ = ["one_save_at_a_time"]


def one_save_at_a_time(ctx: BenchContext) -> None:
    """Part 3 (run.py's module docstring): each method alone, median of ``result.reps``
    repetitions."""
    alone, dcp, rotation, root, result = _Alone(ctx), ctx.dcp, ctx.rotation, ctx.root, ctx.result
    # DCP async_save's first save allocates its stager's buffers (pinned, on CUDA), a first-save
    # cost that part 2's warm-up paid already; without part 2 a warm-up pays it here. No other
    # warm-up is needed: a method's first save, with no previous checkpoint to rotate against,
    # writes into fresh page-cache pages just as a rotating save does (Rotation).
    if not rotation.has("dcp-async"):
        dcp.async_save(root / "dcp-async-warmup").wait()
        rotation.rotate("dcp-async", root / "dcp-async-warmup")
    for rep in range(result.reps):
        ctx.progress(f"one save at a time, repetition {rep + 1} of {result.reps}")
        alone.bound_copy(rep)
        alone.bound_write(rep)
        # The order of the contenders rotates from one repetition to the next: what ran just
        # before (a large delete, a background flush) moves the next one's time here.
        contenders = [alone.torch_save_load, alone.dcp_save_load, alone.dcp_async, alone.smartckpt]
        k = rep % len(contenders)
        for fn in contenders[k:] + contenders[:k]:
            fn(rep)
            gc.collect()
            ctx.on_update(result)  # a bench cut short keeps every contender measured so far


class _Alone:
    """What part 3's measurements share; each method measures one of them once (``rep``: the
    repetition, which names its files)."""

    def __init__(self, ctx: BenchContext) -> None:
        self.mgr, self.policy, self.smart, self.plain = ctx.mgr, ctx.policy, ctx.smart, ctx.plain
        self.dcp, self.rotation, self.root, self.sync = ctx.dcp, ctx.rotation, ctx.root, ctx.sync
        self.result = ctx.result
        plain = ctx.plain
        self.cuda = next(plain.model.parameters()).is_cuda
        self.payload = bytearray(os.urandom(1 << 20)) * 16  # 16 MiB of incompressible bytes
        self.torch_saver = TorchSaver(plain.model, plain.opt)
        self.buffers: list[torch.Tensor] = []

    def bound_copy(self, rep: int) -> None:
        plain, result, buffers, sync = self.plain, self.result, self.buffers, self.sync
        # Taken afresh: a load replaces the optimizer's state tensors.
        tensors = state_tensors(plain.model, plain.opt)
        if not buffers:  # allocated once, outside the timing, as any staging buffer is
            try:
                buffers.extend(torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in tensors)
            except RuntimeError as err:  # pinning can fail (locked-memory limits); pageable then
                result.notes.append(f"copy bound into pageable memory: pinning failed ({err})")
                buffers.extend(torch.empty(t.shape, dtype=t.dtype) for t in tensors)
        sync()
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t, non_blocking=self.cuda)
        sync()
        result.add("bound.copy", time.perf_counter() - t0)

    def bound_write(self, rep: int) -> None:
        path = self.root / "seq.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = self.result.state_bytes
            while left > 0:
                n = min(left, len(self.payload))
                f.write(memoryview(self.payload)[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        self.result.add("bound.write+fsync", time.perf_counter() - t0)
        path.unlink()

    def torch_save_load(self, rep: int) -> None:
        path = self.root / f"torch-{rep}.pt"
        self.sync()
        self.result.add("torch.save+fsync", self.torch_saver.save(path))
        self.result.sizes["torch.save"] = path.stat().st_size
        self.result.add("torch.load+load_state_dict", self.torch_saver.load(path, self.sync))
        self.rotation.rotate("torch", path)

    def dcp_save_load(self, rep: int) -> None:
        path = self.root / f"dcp-{rep}"
        self.sync()
        self.result.add("dcp.save", self.dcp.save(path))
        self.result.sizes["dcp.save"] = dir_bytes(path)
        self.result.add("dcp.load", self.dcp.load(path, self.sync))
        self.rotation.rotate("dcp", path)

    def dcp_async(self, rep: int) -> None:
        plain, result, sync = self.plain, self.result, self.sync
        path = self.root / f"dcp-async-{rep}"
        sync()
        t0 = time.perf_counter()
        plain.step()  # the reference: one step of this model without a save
        sync()
        result.add("train_step_plain", time.perf_counter() - t0)
        # Saved at a step boundary, then one training step, whose update waits for the staging
        # copy: what the loop waits, measured as for smartckpt's lazy save.
        t0 = time.perf_counter()
        pending = self.dcp.async_save(path)
        staged: list[float] = []
        plain.step(before_update=lambda: staged.append(pending.wait_staged()))
        sync()
        result.add("dcp.async_save.step_with_save", time.perf_counter() - t0)
        result.add("dcp.async_save.blocking", pending.call_seconds + sum(staged))
        pending.wait()
        result.add("dcp.async_save.total", time.perf_counter() - t0)
        self.rotation.rotate("dcp-async", path)

    def smartckpt(self, rep: int) -> None:
        # A training step changes every tensor, so the measured save shares nothing with the
        # previous one.
        self.smart.step()
        self.sync()
        self._eager()
        step_with_save = self._lazy()
        t1 = time.perf_counter()
        self.smart.step()
        self.sync()
        self.result.add("train_step", time.perf_counter() - t1)
        self.result.add("train_step_with_lazy_save", step_with_save)
        t0 = time.perf_counter()
        self.mgr.restore()
        self.sync()
        self.result.add("smartckpt.restore", time.perf_counter() - t0)

    def _eager(self) -> None:
        """The eager path: save() copies everything before it returns; then one training step
        (beside the background persist, as DCP's step runs beside its upload)."""
        result = self.result
        t0 = time.perf_counter()
        handle = self.mgr.save(self.smart.steps)
        self.smart.step()
        self.sync()
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

    def _lazy(self) -> float:
        """The lazy path inside a training step: save at a step boundary (the step() call), then
        one real forward/backward/optimizer step, whose pre-hook waits for the deferred copies.
        Returns the time of that step with its save."""
        smart, sync = self.smart, self.sync
        loss = smart.step()
        sync()
        self.policy.fire = True
        t1 = time.perf_counter()
        res = self.mgr.step(smart.steps, loss=loss)
        call = time.perf_counter() - t1
        self.policy.fire = False
        smart.step()
        sync()
        step_with_save = time.perf_counter() - t1
        assert res.handle is not None
        res.handle.wait()
        wait = call + res.handle.loop_wait_seconds - res.handle.blocking_seconds
        self.result.add("smartckpt.lazy_loop_wait", wait)
        self.result.later_lazy_waits.append(wait)
        return step_with_save
