"""L3: the random number generators a training run draws from, captured and restored exactly."""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

import torch

__all__ = ["RNGState"]

logger = logging.getLogger(__name__)


class RNGState:
    """Python ``random``, NumPy's global generator (when NumPy is loaded), torch CPU and every
    initialised CUDA device. Registered automatically by the manager under the name ``rng``."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        np = sys.modules.get("numpy")
        if np is not None:
            state["numpy"] = np.random.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(_as_tuple(state["python"]))
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        if "cuda_seed" in state and torch.cuda.is_available():
            # A rank that did not exist when the checkpoint was written (engine/reshard.py).
            torch.cuda.manual_seed_all(int(state["cuda_seed"]))
        if "cuda" in state:
            if not torch.cuda.is_available():
                logger.warning("checkpoint has CUDA RNG state but no GPU is available; not restored")
                return
            saved = list(state["cuda"])
            n = torch.cuda.device_count()
            if len(saved) != n:
                logger.warning("checkpoint has RNG state for %d GPUs, this machine has %d", len(saved), n)
            torch.cuda.set_rng_state_all(saved[:n])


def _as_tuple(v: Any) -> Any:
    return tuple(_as_tuple(x) for x in v) if isinstance(v, list | tuple) else v
