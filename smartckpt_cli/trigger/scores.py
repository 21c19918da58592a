"""The scores the policies compute from a reading, as plain functions: the seed's risk score
(kept exactly as the seed wrote it), Young/Daly's optimal interval, the logistic function and the
robust z-score :class:`~smartckpt_cli.trigger.adaptive.AdaptivePolicy` judges every signal by.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["robust_z", "seed_score", "sigmoid", "young_daly"]


def sigmoid(x: float) -> float:
    if x < -60:
        return 0.0
    return 1.0 / (1.0 + math.exp(-x))


def seed_score(curv: float, grad_var: float) -> float:
    """The seed's risk score, exactly: 0.7·sigmoid(|curv|/0.03) + 0.3·(1 − sigmoid(grad_var/1e-5)).

    The seed saves when it reaches 0.65. As written it *raises* the score when gradient variance
    is low (and, since sigmoid(|x|) ≥ 0.5, the score is never below 0.35). It is kept exactly as
    the seed wrote it; smartckpt's default policy treats variance the other way round.
    """
    return 0.7 * sigmoid(abs(curv) / 0.03) + 0.3 * (1.0 - sigmoid(grad_var / 1e-5))


def young_daly(cost: float, mtbf: float) -> float:
    """The first-order optimal checkpoint interval sqrt(2·C·MTBF) (Young 1974, Daly 2006)."""
    return math.sqrt(2.0 * max(cost, 0.0) * max(mtbf, 0.0))


def robust_z(x: float, history: deque[float], floor: float) -> float:
    """|x − median| / (1.4826 · MAD) of ``history`` (the MAD scaled to a normal σ), with the
    scale floored at ``floor`` so a constant history does not make every wiggle infinite."""
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    return abs(x - med) / max(1.4826 * mad, floor)
