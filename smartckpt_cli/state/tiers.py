"""WHAT to store: classify every state entry into a tier and pick its precision. Pure.

| tier | what | how |
|---|---|---|
| L1 | every model ``state_dict()`` entry (buffers too), optimizer hyperparameters, schedulers, scalers, step counters, data position | lossless |
| L2 | optimizer per-parameter tensors (``exp_avg``, ``exp_avg_sq``, momentum, LBFGS history, Adafactor factors...) | ``exact``, or reduced by precision policy where shaped like the parameter |
| L3 | RNG of Python, NumPy, torch CPU and every CUDA device | exact |
| L4 | per-step statistics | not stored, reset on resume (only by rule) |
| L5 | step, time, host, versions, trigger reason | JSON in the manifest |

Rules (YAML ``tiers:`` list, first match wins) override the default per key: ``{match: glob,
tier: L1..L4, precision: exact|bf16|fp16}``. L1 and L3 are lossless by definition: a rule asking
for a reduced precision there is refused.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from smartckpt_cli.errors import ConfigError

__all__ = ["PRECISIONS", "TIERS", "EntryPlan", "TierRule", "classify", "parse_rules"]

TIERS = ("L1", "L2", "L3", "L4")
PRECISIONS = ("exact", "bf16", "fp16")


@dataclass(frozen=True)
class TierRule:
    match: str
    tier: str | None = None
    precision: str | None = None


@dataclass(frozen=True)
class EntryPlan:
    key: str
    tier: str
    transform: str  # precision.reduce transform: none | bf16 | sqrt_fp16

    @property
    def stored(self) -> bool:
        return self.tier != "L4"


def parse_rules(raw: Any) -> tuple[TierRule, ...]:
    """Validate the YAML ``tiers`` list; errors name the offending rule."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("'tiers' must be a list of {match, tier, precision} rules")
    rules = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("match"), str):
            raise ConfigError(f"tiers[{i}]: each rule needs a string 'match' glob")
        unknown = set(item) - {"match", "tier", "precision"}
        if unknown:
            raise ConfigError(f"tiers[{i}]: unknown key '{sorted(unknown)[0]}'")
        tier, prec = item.get("tier"), item.get("precision")
        if tier is not None and tier not in TIERS:
            raise ConfigError(f"tiers[{i}]: tier must be one of {', '.join(TIERS)}, not {tier!r}")
        if prec is not None and prec not in PRECISIONS:
            raise ConfigError(f"tiers[{i}]: precision must be one of {', '.join(PRECISIONS)}, not {prec!r}")
        if prec not in (None, "exact") and tier in ("L1", "L3"):
            raise ConfigError(f"tiers[{i}]: {tier} is lossless; precision {prec!r} is only for L2")
        rules.append(TierRule(item["match"], tier, prec))
    return tuple(rules)


def _transform(key: str, precision: str) -> str:
    if precision == "bf16":
        return "bf16"
    if precision == "fp16":
        # The seed's rule: first moments stay fp32, second moments go to half (sqrt domain).
        return "sqrt_fp16" if key.rsplit("/", 1)[-1].endswith("exp_avg_sq") else "none"
    return "none"


def default_tier(key: str, kind: str, *, numel: int, floating: bool) -> str:
    if kind == "rng":
        return "L3"
    if kind == "optimizer":
        parts = key.split("/")
        # optimizer/state/<param id>/<name>: per-parameter tensors are moments (L2), except
        # scalar counters such as Adam's `step`, which must stay exact (L1).
        if len(parts) >= 4 and parts[1] == "state" and floating and numel > 1:
            return "L2"
    return "L1"


def classify(
    key: str,
    kind: str,
    *,
    numel: int,
    floating: bool,
    precision: str,
    rules: tuple[TierRule, ...] = (),
    moment: bool = True,
) -> EntryPlan:
    """``moment``: the entry is a per-element moment (shaped like its parameter, optstate.py).
    The global ``precision`` reduces only those; a rule's precision applies to what it matches.
    Either way the codec reduces only real floats wider than the target (dtypes.reducible)."""
    tier = default_tier(key, kind, numel=numel, floating=floating)
    prec = precision if moment else "exact"
    for rule in rules:
        if fnmatch.fnmatchcase(key, rule.match):
            tier = rule.tier or tier
            prec = rule.precision or prec
            break
    if tier != "L2" or not floating:
        return EntryPlan(key, tier, "none")
    return EntryPlan(key, tier, _transform(key, prec))
