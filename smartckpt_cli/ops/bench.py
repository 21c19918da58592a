"""``smartckpt bench``: smartckpt against the tools users would otherwise pick, in one run, on the
CPU or on a CUDA device (``--device``; CUDA when there is one).

Three parts, each reported as soon as it is done (``on_update``), so a bench cut short still
leaves the figures it has:

1. **First save.** A fresh manager is registered and restored, the model trains for ``every``
   seconds (5 at most; a run that saves every ``every`` seconds trains that long before its first
   save), then the first save goes through ``mgr.step()`` (the lazy path): what the loop waited.
2. **Throughput with a save every ``every`` seconds** for no checkpointing, ``torch.save``, DCP
   ``async_save`` and smartckpt, in rotated rounds (bench_throughput.py): the figure users feel.
3. **One save at a time**, ``reps`` repetitions: every figure is the median over them, and the
   methods are interleaved within each repetition, in an order that rotates from one repetition
   to the next (A B C D, B C D A, ...), so that a noisy neighbour, or what the previous method
   left behind, hurts all of them alike. Anchors:

   * ``torch.save`` + fsync (the traditional baseline) and ``torch.load`` + ``load_state_dict``;
   * ``torch.distributed.checkpoint`` ``save``, ``load`` and ``async_save`` (blocking time: the
     call and its staging copy; total time: until written), staging as in bench_savers.py;
   * the machine's lower bounds: copying the state into preallocated buffers (pinned host memory
     on CUDA: the device-to-host bound), and a sequential write + fsync of as many bytes.

   smartckpt runs as in training, one manager for the whole bench (``keep_last=2``), and is
   measured on its eager path (``save()``: blocking time = the whole snapshot copy), its lazy path
   inside a real training step (what the loop actually waits), the time until the journal commit,
   the bytes on disk and the restore time.

smartckpt trains its own model (its manager's optimizer hooks are on it); the other contenders
share a second model built the same way. No rich here: the CLI renders the result.
"""

from __future__ import annotations

import functools
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

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.ops.bench_savers import DcpSaver, Rotation, TorchSaver, dir_bytes
from smartckpt_cli.ops.bench_throughput import Throughput, Trainer, run_throughput

__all__ = ["RATIOS", "BenchResult", "build_model", "resolve_device", "run_bench", "train_step"]

logger = logging.getLogger(__name__)

# Defaults per device: the CPU bench keeps the figures the README has always shown; on a GPU
# ~5 GB of state (the size the targets are stated for) and a batch whose step takes a
# large fraction of a second on an H200, as in a real fine-tune of such a model.
DEFAULT_PARAMS = {"cpu": 100_000_000, "cuda": 400_000_000}
DEFAULT_BATCH = {"cpu": 8, "cuda": 4096}


def resolve_device(name: str | None) -> torch.device:
    """``cpu`` or ``cuda`` (None: CUDA when torch sees a device); a clear error otherwise."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, not {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device here; use --device cpu"
        )
    return torch.device(name)


def build_model(
    params: int, *, width: int = 4096, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of about ``params`` parameters on ``device``, with AdamW state after one real step."""
    width = min(width, max(64, int((params / 4) ** 0.5)))
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt)
    return model, opt


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: int = 8,
    before_update: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One forward/backward/AdamW step on a random batch made on the model's device; returns
    the loss, left on the device. ``before_update`` runs between backward and the update."""
    p = next(model.parameters())
    loss = model(torch.randn(batch, p.shape[1], device=p.device)).pow(2).mean()
    loss.backward()
    if before_update is not None:
        before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


_train_step = train_step  # the name benchmarks/ scripts used before


def _state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*model.state_dict().values()] + [
        t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)
    ]


@dataclass
class BenchResult:
    params: int
    state_bytes: int
    reps: int
    device: str = "cpu"
    info: dict[str, Any] = field(default_factory=dict)  # device name, torch, batch, DCP staging...
    samples: dict[str, list[float]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    throughput: Throughput | None = None
    later_lazy_waits: list[float] = field(default_factory=list)  # every lazy save after the first
    done: list[str] = field(default_factory=list)  # parts finished: first-save, throughput, saves

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def median(self, name: str) -> float | None:
        vals = self.samples.get(name)
        return statistics.median(vals) if vals else None

    def ratio(self, a: str, b: str) -> float | None:
        x, y = self.median(a), self.median(b)
        return None if x is None or not y else x / y

    def first_save(self) -> dict[str, Any]:
        """The first lazy save's loop wait against every later lazy save's (issue 20: ≤ 2x)."""
        first = self.median("smartckpt.first_lazy_loop_wait")
        later = statistics.median(self.later_lazy_waits) if self.later_lazy_waits else None
        return {
            "first_loop_wait": first,
            "later_loop_waits": self.later_lazy_waits,
            "median_later_loop_wait": later,
            "ratio": first / later if first is not None and later else None,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "state_bytes": self.state_bytes,
            "reps": self.reps,
            "device": self.device,
            **self.info,
            "parts_done": self.done,
            "complete": self.done == ["first-save", "throughput", "saves"],
            "median_seconds": {k: self.median(k) for k in self.samples},
            "samples": self.samples,
            "bytes_on_disk": self.sizes,
            "ratios": {name: self.ratio(a, b) for name, (a, b) in RATIOS.items()},
            "first_save": self.first_save(),
            "throughput": self.throughput.to_json() if self.throughput is not None else None,
            "notes": self.notes,
        }


# name -> (numerator, denominator): the figures the targets are stated in.
RATIOS: dict[str, tuple[str, str]] = {
    "blocking / torch.save+fsync": ("smartckpt.blocking", "torch.save+fsync"),
    "blocking / DCP async_save blocking": ("smartckpt.blocking", "dcp.async_save.blocking"),
    "blocking / copy lower bound": ("smartckpt.blocking", "bound.copy"),
    "lazy loop wait / copy lower bound": ("smartckpt.lazy_loop_wait", "bound.copy"),
    "lazy loop wait / DCP async_save blocking": ("smartckpt.lazy_loop_wait", "dcp.async_save.blocking"),
    "first lazy loop wait / later lazy loop wait": (
        "smartckpt.first_lazy_loop_wait",
        "smartckpt.lazy_loop_wait",
    ),
    "committed / torch.save+fsync": ("smartckpt.committed", "torch.save+fsync"),
    "committed / DCP save": ("smartckpt.committed", "dcp.save"),
    "committed / DCP async_save total": ("smartckpt.committed", "dcp.async_save.total"),
    "committed / write lower bound": ("smartckpt.committed", "bound.write+fsync"),
    "restore / torch.load+load_state_dict": ("smartckpt.restore", "torch.load+load_state_dict"),
    "restore / DCP load": ("smartckpt.restore", "dcp.load"),
}


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
        sum(t.numel() * t.element_size() for t in _state_tensors(plain.model, plain.opt)),
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
        tensors = _state_tensors(plain.model, plain.opt)
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
        pending = dcp.async_save(path)
        # What the loop must wait before its next optimizer update may change the tensors.
        result.add("dcp.async_save.blocking", pending.call_seconds + pending.wait_staged())
        pending.wait()
        result.add("dcp.async_save.total", time.perf_counter() - t0)
        rotation.rotate("dcp-async", path)

    def smartckpt(rep: int) -> None:
        # A training step changes every tensor, so the measured save shares nothing with the
        # previous one.
        smart.step()
        sync()
        handle = mgr.save(smart.steps)
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
