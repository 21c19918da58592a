"""The tools ``smartckpt bench`` measures smartckpt against, as a careful user would run them.

* ``torch.save`` of the model's and the optimizer's state dicts into one file, flushed and
  fsynced (durable, like a smartckpt commit), restored with ``torch.load`` + ``load_state_dict``;
* ``torch.distributed.checkpoint`` (DCP): ``save``, ``async_save`` and ``load``. ``async_save``
  gets the best staging the installed torch offers, kept for the whole bench so its buffers are
  allocated once, as DCP's documentation recommends: ``DefaultStager`` with asynchronous staging
  (on a side stream into pinned memory on CUDA, on a background thread on the CPU) where the
  installed torch has it (2.13 does), so that its copy overlaps the next forward and backward as
  smartckpt's lazy copy does; else, on CUDA, ``BlockingAsyncStager`` with a cached pinned copy;
  else plain ``async_save`` (staging into pageable memory inside the call). Which one ran is
  reported (:attr:`DcpSaver.staging`).

Every saver *rotates*: its new checkpoint is written while the previous one still exists, and the
previous one is deleted only afterwards, outside the timed region (see :class:`Rotation`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["DcpSaver", "PendingAsync", "Rotation", "TorchSaver", "dir_bytes"]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Rotation:
    """The previous checkpoint of each saver, deleted once the next one is durable.

    Deleting first would let the new file reuse the page-cache pages just freed, which on a
    virtual machine writes several times faster than fresh pages (measured on the 2-core
    development VM: 2.8-3.1 GB/s into recycled pages, 0.3-0.4 GB/s into new ones) and would
    compare a checkpoint-less moment against a safe save."""

    def __init__(self) -> None:
        self._previous: dict[str, Path] = {}

    def has(self, name: str) -> bool:
        return name in self._previous

    def rotate(self, name: str, path: Path) -> None:
        old = self._previous.get(name)
        if old is not None and old != path:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        self._previous[name] = path


class TorchSaver:
    """``torch.save`` + fsync of the state dicts; ``torch.load`` + ``load_state_dict``."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def save(self, path: Path) -> float:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def load(self, path: Path, sync: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        sd = torch.load(path, weights_only=True)  # back onto the device it was saved from
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        sync()
        seconds = time.perf_counter() - t0
        del sd
        return seconds


class PendingAsync:
    """One DCP ``async_save`` in flight: ``staged`` must be waited before the next optimizer
    update changes the tensors; ``done`` once the checkpoint is written."""

    def __init__(self, response: Any, call_seconds: float) -> None:
        self.call_seconds = call_seconds
        # torch >= 2.9 with an asynchronous stager answers with (staging, upload) futures;
        # otherwise one future, and staging finished before async_save returned.
        self._staging = getattr(response, "staging_completion", None)
        self._upload = getattr(response, "upload_completion", response)

    def wait_staged(self) -> float:
        """Seconds waited for the staging copy (0 when it finished inside the call)."""
        if self._staging is None:
            return 0.0
        t0 = time.perf_counter()
        self._staging.result()
        return time.perf_counter() - t0

    def done(self) -> bool:
        return bool(self._upload.done())

    def wait(self) -> None:
        if self._staging is not None:
            self._staging.result()
        self._upload.result()


class DcpSaver:
    """DCP ``save``/``async_save``/``load`` of one model and optimizer (no process group: DCP
    then saves as a single process)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.model, self.opt = model, opt
        self.stager, self.staging = _stager(device)

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optimizer": osd}

    def save(self, path: Path) -> float:
        t0 = time.perf_counter()
        self.dcp.save(self.state(), checkpoint_id=str(path))
        return time.perf_counter() - t0

    def async_save(self, path: Path) -> PendingAsync:
        t0 = time.perf_counter()
        extra = {"async_stager": self.stager} if self.stager is not None else {}
        response = self.dcp.async_save(self.state(), checkpoint_id=str(path), **extra)
        return PendingAsync(response, time.perf_counter() - t0)

    def load(self, path: Path, sync: Callable[[], None]) -> float:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t0 = time.perf_counter()
        sd = self.state()  # DCP loads in place, into these very tensors
        self.dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        sync()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def _stager(device: torch.device) -> tuple[Any, str]:
    """The best ``async_save`` staging this torch offers for ``device``, and its description:
    staging on DCP's own thread, so the copy overlaps the next forward and backward as
    smartckpt's lazy copy does (into pinned memory on CUDA, where that speeds the copy up)."""
    cuda = device.type == "cuda"
    memory = "pinned memory" if cuda else "pageable memory"
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
        where = "a side stream" if cuda else "a background thread"
        return DefaultStager(options), f"DefaultStager: {memory}, asynchronous staging on {where}"
    except (ImportError, TypeError, AssertionError, RuntimeError):
        pass
    plain = "plain async_save (staging copy into pageable memory, inside the call)"
    if not cuda:
        return None, plain
    try:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return (
            BlockingAsyncStager(cache_staged_state_dict=True),
            "BlockingAsyncStager: cached pinned copy, staged inside the call",
        )
    except (ImportError, TypeError):
        return None, plain
