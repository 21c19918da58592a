"""The training loop that benchmarks/throughput.py and benchmarks/loop_wait.py time: the two
models they train (``--model small|bench``), a pool of batches, and what a save cost the loop,
read from the loop's own clock.

A save's **loop wait**, from the loop's clock: the save is taken at the end of step k (``mgr.step``,
``mgr.save`` or DCP's ``async_save`` right after the optimizer step); step k and step k+1 (whose
optimizer update waits for the copies still running) are compared with m, the median step of the
same loop outside any save's window: (t_k − m) + (t_k+1 − m). What the steps after those lose while
the save is encoded and written in the background, until it is written, is its **background**
cost: Σ (t_j − m).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from smartckpt_cli.bench.model import build_model

__all__ = ["MODELS", "Data", "SaveWindow", "build", "describe", "loop_costs"]

MODELS = {
    "small": {"batch": 64},  # about 3 ms a step on two CPU cores
    "bench": {"batch": 8},  # smartckpt bench's model: about 0.7 s a step there
}


def build(model: str, params: float, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``small``: 8 Linear(256) with ReLU between (step_cost.py's CPU model), AdamW; ``bench``:
    ``smartckpt bench``'s MLP of about ``params`` parameters, AdamW."""
    if model == "bench":
        return build_model(int(params), device=device)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(8):
        layers.append(torch.nn.Linear(256, 256))
        if i < 7:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers).to(device)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-4)


def describe(model: str, net: torch.nn.Module, batch: int) -> str:
    params = sum(q.numel() for q in net.parameters())
    if model == "bench":
        return f"MLP of {params / 1e6:.1f}M parameters, batch {batch}, AdamW"
    return f"MLP 8x256 with ReLU ({params / 1e6:.2f}M parameters), batch {batch}, AdamW"


class Data:
    """A pool of 16 (input, target) batches made on the model's device beforehand."""

    def __init__(self, net: torch.nn.Module, batch: int) -> None:
        first = next(net.parameters())
        g = torch.Generator().manual_seed(1)
        self.pool = [
            (
                torch.randn(batch, first.shape[1], generator=g).to(first.device),
                torch.randn(batch, first.shape[1], generator=g).to(first.device),
            )
            for _ in range(16)
        ]
        self.i = 0

    def step(
        self, net: torch.nn.Module, opt: torch.optim.Optimizer, before_update: Any = None
    ) -> torch.Tensor:
        """Forward, backward, (``before_update``), the optimizer step; the loss."""
        x, y = self.pool[self.i % len(self.pool)]
        self.i += 1
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        if before_update is not None:
            before_update()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss


@dataclass
class SaveWindow:
    """One save in a list of step times: taken at the end of step ``index``; written by the end
    of step ``done_at`` (None: after the last step of the list)."""

    index: int
    done_at: int | None


def loop_costs(runs: list[tuple[list[float], list[SaveWindow]]], local: bool = False) -> dict[str, Any]:
    """Per save, its loop wait and background cost (module docstring), over several lists of
    step times (blocks) of one loop; m is the median over all of them outside the windows, or,
    with ``local``, the median of the steps before the save in its own block (what the loop did
    just before: drift in the machine's speed between blocks then does not count)."""
    clean: list[float] = []
    for steps, saves in runs:
        busy: set[int] = set()
        for s in saves:
            end = s.done_at if s.done_at is not None else len(steps) - 1
            busy.update(range(s.index, max(end, s.index + 1) + 1))
        clean += [t for i, t in enumerate(steps) if i not in busy]
    ref = statistics.median(clean)
    out = []
    for steps, saves in runs:
        for s in saves:
            m = statistics.median(steps[: s.index]) if local and s.index > 0 else ref
            pair = steps[s.index : s.index + 2]
            end = s.done_at if s.done_at is not None else len(steps) - 1
            after = steps[s.index + 2 : end + 1]
            out.append(
                {
                    "loop_wait_s": sum(t - m for t in pair) if len(pair) == 2 else None,
                    "ref_step_s": m,
                    "save_step_s": pair[0],
                    "next_step_s": pair[1] if len(pair) == 2 else None,
                    "background_s": sum(t - m for t in after),
                    "background_steps": len(after),
                }
            )
    return {"ref_step_s": ref, "clean_steps": len(clean), "saves": out}
