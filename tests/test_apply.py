"""smartckpt_cli/state/apply.py: apply_checkpoint loads a verified checkpoint into live objects, in place,
only after checking every object. The checkpoints are real: written by CheckpointManager, read
back with restore.load_checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.engine.restore import Loaded, candidates, load_checkpoint
from smartckpt_cli.errors import StateMismatchError
from smartckpt_cli.state.apply import apply_checkpoint
from smartckpt_cli.store.directory import open_store


def _saved(directory: Path, tiers: list[dict[str, str]] | None = None, **objects: Any) -> Loaded:
    """Save ``objects`` at step 1 and load that checkpoint back (not applied)."""
    with sc.CheckpointManager(directory, tiers=tiers) as mgr:
        mgr.register(**objects)
        mgr.save(1, blocking=True)
    store = open_store(directory)
    state = store.journal.read()
    (record,) = candidates(state.records)
    return load_checkpoint(store.storage, store.blobs, record, state.store_id)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(4, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_parameters_keep_their_identity_and_optimizer_references(tmp_path: Path, isolated: None) -> None:
    model, opt = _trained(0)
    loaded = _saved(tmp_path / "store", model=model, optimizer=opt)
    fresh, fresh_opt = _trained(1)
    params = list(fresh.parameters())
    pointers = [p.data_ptr() for p in params]

    apply_checkpoint(loaded, {"model": ("module", fresh), "optimizer": ("optimizer", fresh_opt)})

    assert all(a is b for a, b in zip(fresh.parameters(), params, strict=True))
    assert [p.data_ptr() for p in fresh.parameters()] == pointers
    assert all(a is b for a, b in zip(fresh_opt.param_groups[0]["params"], params, strict=True))
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # The next update moves the live parameters exactly as it moves the saved run's.
    _step(model, opt)
    _step(fresh, fresh_opt)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_a_mismatch_in_the_second_object_leaves_the_first_untouched(tmp_path: Path, isolated: None) -> None:
    model, _ = _trained(0)
    loaded = _saved(tmp_path / "store", model=model, head=torch.nn.Linear(8, 2))
    fresh, _ = _trained(1)
    before = _copy(fresh)
    msg = r"^head/weight: checkpoint shape 2x8 does not match the model's 2x9$"
    with pytest.raises(StateMismatchError, match=msg):
        apply_checkpoint(loaded, {"model": ("module", fresh), "head": ("module", torch.nn.Linear(9, 2))})
    for k, v in before.items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_an_object_missing_from_the_checkpoint_is_left_as_it_is(
    tmp_path: Path, isolated: None, caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = _trained(0)
    loaded = _saved(tmp_path / "store", model=model)
    fresh, _ = _trained(1)
    extra = torch.nn.Linear(3, 3)
    extra_before = _copy(extra)
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli.state.apply"):
        apply_checkpoint(loaded, {"model": ("module", fresh), "extra": ("module", extra)})
    assert [r.getMessage() for r in caplog.records] == [
        "'extra' is not in the checkpoint of step 1; left as it is"
    ]
    for k, v in extra_before.items():
        assert torch.equal(extra.state_dict()[k], v), k
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


class Stats:
    def __init__(self, hist: float, total: float) -> None:
        self.hist, self.total = torch.full((4,), hist), torch.tensor(total)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"hist": self.hist, "total": self.total}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.hist, self.total = sd["hist"].clone(), sd["total"].clone()


def test_an_l4_entry_is_reset_to_the_live_value(tmp_path: Path, isolated: None) -> None:
    loaded = _saved(tmp_path / "store", tiers=[{"match": "stats/hist", "tier": "L4"}], stats=Stats(5.0, 42.0))
    assert loaded.manifest["not_stored"] == ["stats/hist"] and "stats/hist" not in loaded.tensors
    live = Stats(7.0, 0.0)
    apply_checkpoint(loaded, {"stats": ("state", live)})
    assert torch.equal(live.hist, torch.full((4,), 7.0))  # not stored: the live value stays
    assert torch.equal(live.total, torch.tensor(42.0))  # stored: restored
