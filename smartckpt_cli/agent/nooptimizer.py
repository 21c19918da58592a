"""Noticing a loop that trains with no ``torch.optim`` optimizer (a hand-written update), which
zero-code mode cannot checkpoint: said once on stderr and reported to ``smartckpt run`` (the
child's report's ``no_optimizer``), so that the run's summary says why nothing was saved.

Apart from :mod:`.runtime`, which owns the hooks and calls in here from its ``backward``
wrapper: this is one question (has an iteration passed with no optimizer step?) answered by
watching one parameter's gradient, and it is off for good at the first optimizer step.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from smartckpt_cli.engine.report import report

__all__ = ["NoOptimizer", "say_no_optimizer"]


class NoOptimizer:
    """Backward passes that no ``torch.optim`` optimizer follows (a hand-written update): said
    once, as soon as it is clear, and reported to ``smartckpt run``; off for good at the first
    optimizer step. An iteration shows as gradients reset between two backward passes (the
    model's ``zero_grad``; gradient accumulation keeps them), watched on one parameter the
    first loss depends on. ``seen(iterations)`` is called at each iteration from the
    ``ITERATIONS``-th on, until the runtime drops the watch."""

    ITERATIONS = 3

    def __init__(self, seen: Callable[[int], None]) -> None:
        self.seen = seen
        self.leaf: Any = None  # weakref to a parameter the loss depends on
        self.grad: tuple[int, int] | None = None  # (id, version) of its gradient after backward
        self.iterations = 0

    def backward(self, loss: torch.Tensor) -> None:
        if self.leaf is None:
            self.leaf = _first_leaf(loss) or (lambda: None)  # none found: watch nothing
            return
        p = self.leaf()
        if p is None:
            return
        g = p.grad
        if self.grad is not None and (g is None or (id(g), g._version) != self.grad):
            self.iterations += 1
            if self.iterations >= self.ITERATIONS:
                self.seen(self.iterations)
        self.grad = None

    def after(self) -> None:
        p = self.leaf() if self.leaf is not None else None
        g = p.grad if p is not None else None
        self.grad = (id(g), g._version) if g is not None else None


def _first_leaf(loss: torch.Tensor) -> Any:
    """A weak reference to a leaf tensor ``loss`` depends on (its graph walked up to 1000 nodes)."""
    todo, seen = [loss.grad_fn], 0
    while todo and seen < 1000:
        node = todo.pop()
        seen += 1
        if node is None:
            continue
        var = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if isinstance(var, torch.Tensor):
            return weakref.ref(var)
        todo.extend(n for n, _ in node.next_functions)
    return None


def say_no_optimizer(iterations: int) -> None:
    """Say it and report it, unless the script checkpoints with its own manager or an optimizer
    exists after all."""
    import gc

    from smartckpt_cli.engine import manager as engine_manager

    if engine_manager.managers_built() > 0:
        return  # the script checkpoints with its own manager: it needs no optimizer
    if any(issubclass(type(o), torch.optim.Optimizer) for o in gc.get_objects()):
        return  # there is one: a GradScaler skipping its first steps, or a loop yet to step it
    print(
        f"smartckpt: backward() has run for {iterations} iterations but no torch.optim optimizer has "
        "stepped: zero-code checkpointing needs one, so nothing is checkpointed; for a hand-written "
        "update, use a CheckpointManager in the script (README: Usage)",
        file=sys.stderr,
        flush=True,
    )
    report(no_optimizer=True)
