"""Where the saves of :class:`~smartckpt_cli.engine.manager.CheckpointManager` are staged, decided
once per state layout: staging buffers prepared in the background before the first save, the RAM
tier's slots in their place, or a save in pieces through one buffer under ``memory_budget``.

Apart from :mod:`.stepping` and :mod:`.saving` because both ask it (the first step after a
registration or a restore prepares, a save before the first step plans) and it is neither a
step's nor a save's work: it sizes the encoders to the state (engine/budget.py, pure) and holds
the plan's outcome, the pager and the line said once. Training thread. A mixin, as
:mod:`.stepping` is: the state it reads is the manager's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from smartckpt_cli.config import Settings, parse_size
from smartckpt_cli.engine.budget import StagingPlan, encoder_reserve, encoding_for, plan_staging
from smartckpt_cli.engine.pager import Pager
from smartckpt_cli.engine.ramtier import RamTier
from smartckpt_cli.engine.snapshot import Spec, Stager, staging_specs
from smartckpt_cli.engine.writer import Persister

__all__ = ["StagingPrep"]

logger = logging.getLogger(__name__)


class StagingPrep:
    """The manager's staging preparation and memory-budget plan (module docstring)."""

    settings: Settings
    _objects: dict[str, tuple[str, Any]]
    _prepare: bool
    _pager: Pager | None
    _budgeted: bool
    _budget_line: str | None
    _stager: Stager
    _ram: RamTier | None
    _ram_due: float
    _persister: Persister
    wait: Callable[[], Any]

    def _prepare_staging(self) -> None:
        """Staging buffers for the first save, made in the background (snapshot.py)."""
        self._prepare = False
        try:
            specs = staging_specs(self._objects, precision=self.settings.precision, rules=self.settings.tiers)
        except Exception as err:  # the save allocates what it needs, as before
            logger.debug("staging not prepared: %s", err)
            return
        plan = self._plan_budget(specs)
        if plan.piece is not None:
            return  # a save in pieces: one buffer of a piece's size, made by the first save (pager.py)
        # With the RAM tier the staging buffers are its slots, in shared memory (ramtier.py).
        # The slot's pages are faulted in at normal priority: the first RAM snapshot waits for
        # them (staging beside the slot would hold a second copy of the state), and at nice 10
        # behind a busy training loop that took past the first save (first_save.py --ram).
        if self._ram is not None and self._ram.plan(specs, nice=0, count=plan.slots):
            if not math.isfinite(self._ram_due):
                self._ram_due = time.monotonic() + self._ram.interval()
            return
        self._stager.prepare(specs, nice=self.settings.background_nice)

    def _plan_budget(self, specs: list[Spec]) -> StagingPlan:
        """What ``memory_budget`` allows for a state of ``specs`` (engine/budget.py): the RAM
        slots, or a save in pieces; said once when it changes how saves run."""
        s = self.settings
        state = sum(sp.shape.numel() * torch.empty((), dtype=sp.dtype).element_size() for sp in specs)
        # the encoders' scratch sized to the state (a small state's would be larger than the state)
        chunk, workers = encoding_for(state, chunk=s.chunk_mb << 20, workers=s.n_workers)
        if (chunk, workers) != (self._persister.chunk_bytes, self._persister.workers):
            self.wait()  # between saves
            self._persister.tune(chunk, workers)
            if self._ram is not None:
                self._ram.chunk_bytes = chunk  # the RAM tier's hashes are the writer's chunks
        plan = plan_staging(
            state,
            budget=parse_size(s.memory_budget) if s.memory_budget else None,
            reserve=encoder_reserve(workers, chunk),
            chunk=chunk,
            ram=self._ram is not None and self._ram.active,
            slots=s.ram_slots,
        )
        self._budgeted = True
        if plan.line is not None and plan.line != self._budget_line:
            logger.warning("smartckpt: %s", plan.line)
        self._budget_line = plan.line
        if plan.piece is None:
            self._pager = None
        else:
            if self._ram is not None:
                self._ram.stand_down()  # said in the plan's line
            if self._pager is None or self._pager.piece != plan.piece:
                self._pager = Pager(plan.piece, chunk)
        return plan
