"""smartckpt_cli/state/registry.py: ``adapt`` decides an object's kind once, from one ordered list of
(predicate, kind, wrap); ``register_kind`` appends to it and the first match wins."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from smartckpt_cli.state import registry
from smartckpt_cli.state.data import LoaderState
from smartckpt_cli.state.registry import adapt, register_kind


@pytest.fixture
def kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(registry, "_KINDS", list(registry._KINDS))


class Stateful:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Bare:
    pass


def test_modules_optimizers_and_state_objects_are_returned_as_they_are() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    obj = Stateful()
    assert adapt(model) == ("module", model) and adapt(model)[1] is model
    assert adapt(opt)[0] == "optimizer" and adapt(opt)[1] is opt
    assert adapt(sched)[0] == "state" and adapt(sched)[1] is sched
    assert adapt(obj)[0] == "state" and adapt(obj)[1] is obj


def test_a_plain_dataloader_is_wrapped_and_a_stateful_one_is_not() -> None:
    loader = DataLoader(list(range(6)), batch_size=2)
    kind, wrapped = adapt(loader)
    assert kind == "data" and isinstance(wrapped, LoaderState) and wrapped.loader is loader
    assert wrapped.state_dict() == {
        "epochs": 0,
        "batches": 0,
        "generators": [],
        "sampler_epochs": [],
        "started": False,
    }

    class StatefulLoader(DataLoader):  # torchdata's StatefulDataLoader has its own state_dict
        def state_dict(self) -> dict[str, Any]:
            return {"position": 3}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    own = StatefulLoader(list(range(6)), batch_size=2)
    assert adapt(own)[0] == "state" and adapt(own)[1] is own


def test_an_object_without_state_dict_is_refused_by_its_type_name() -> None:
    with pytest.raises(TypeError, match=r"^cannot checkpoint a Bare: it has no state_dict/load_state_dict$"):
        adapt(Bare())
    with pytest.raises(TypeError, match=r"^cannot checkpoint a int:"):
        adapt(3)


def test_register_kind_first_match_wins(kinds: None) -> None:
    register_kind(lambda o: isinstance(o, Bare), "bare", lambda o: ("wrapped", o))
    bare = Bare()
    assert adapt(bare) == ("bare", ("wrapped", bare))
    # A later kind does not override an earlier one that matches too.
    register_kind(lambda o: isinstance(o, Stateful), "late")
    register_kind(lambda o: isinstance(o, Bare), "also-bare")
    assert adapt(Stateful())[0] == "state"
    assert adapt(bare)[0] == "bare"
