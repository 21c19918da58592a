"""smartckpt_cli/engine/prestep.py: Boundary keeps the state of the last step boundary (RNG, data position,
param-group settings) for a save taken in the optimizer pre-hook, and answers None when it cannot
stand for that boundary (a buffer moved, a param group added, nothing captured)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from smartckpt_cli.engine.prestep import Boundary
from smartckpt_cli.state.data import LoaderState
from smartckpt_cli.state.rng import RNGState


@pytest.fixture
def objects(isolated: None) -> dict[str, tuple[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seeded = torch.Generator().manual_seed(1)
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True, generator=seeded)
    return {
        "model": ("module", model),
        "optimizer": ("optimizer", opt),
        "rng": ("rng", RNGState()),
        "data": ("data", LoaderState(loader)),
    }


def _captured(objects: dict[str, tuple[str, Any]]) -> Boundary:
    iter(objects["data"][1].loader)  # an epoch has started
    boundary = Boundary()
    boundary.capture(7, objects)
    return boundary


def test_objects_answer_the_boundary_states(objects: dict[str, tuple[str, Any]]) -> None:
    boundary = _captured(objects)
    rng_then = torch.get_rng_state()
    model, opt = objects["model"][1], objects["optimizer"][1]
    # Between the boundary and the pre-hook: the loader yields a batch, forward draws random
    # numbers, and the loop sets this step's learning rate.
    next(iter(objects["data"][1].loader))
    torch.randn(3)
    opt.param_groups[0]["lr"] = 0.05
    assert objects["data"][1].state_dict()["batches"] == 1

    at = boundary.objects(objects)
    assert at is not None and boundary.step == 7
    assert list(at) == list(objects) and [k for k, _ in at.values()] == [k for k, _ in objects.values()]
    assert at["model"][1] is model  # not captured: read as it is
    assert torch.equal(at["rng"][1].state_dict()["torch"], rng_then)
    data = at["data"][1].state_dict()
    assert (data["epochs"], data["batches"], data["started"]) == (1, 0, True)
    groups = at["optimizer"][1].state_dict()["param_groups"]
    assert [(g["lr"], g["momentum"], g["params"]) for g in groups] == [(0.1, 0.9, [0, 1, 2, 3])]
    assert opt.param_groups[0]["lr"] == 0.05  # the live optimizer is not changed
    assert at["optimizer"][1].param_groups is opt.param_groups


def test_a_buffer_changed_after_capture_gives_none(objects: dict[str, tuple[str, Any]]) -> None:
    boundary = _captured(objects)
    assert boundary.objects(objects) is not None
    model = objects["model"][1]
    model.train()
    model(torch.randn(2, 4))  # BatchNorm updates its running statistics in place
    assert boundary.objects(objects) is None


def test_a_param_group_added_after_capture_gives_none(objects: dict[str, tuple[str, Any]]) -> None:
    boundary = _captured(objects)
    objects["optimizer"][1].add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert boundary.objects(objects) is None


def test_nothing_captured_or_cleared_gives_none(objects: dict[str, tuple[str, Any]]) -> None:
    boundary = Boundary()
    assert boundary.objects(objects) is None
    boundary.capture(3, objects)
    assert boundary.objects(objects) is not None
    boundary.clear()
    assert boundary.step is None and boundary.objects(objects) is None
