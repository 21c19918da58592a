"""``smartckpt export``: the file loads without smartckpt into a fresh model, which then gives the
trained model's outputs (torch.load(weights_only=True) and safetensors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from smartckpt_cli.cli.app import app
from smartckpt_cli.ops.demo_train import build
from smartckpt_cli.ops.demo_train import main as train

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A store whose newest checkpoint (step 20) is the final state, and that final state as the
    training process itself saved it with torch.save."""
    base = tmp_path_factory.mktemp("trained")
    final = base / "final.pt"
    assert (
        train(["--dir", str(base / "store"), "--steps", "20", "--save-every", "5", "--out", str(final)]) == 0
    )
    return base / "store", torch.load(final, weights_only=True)


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model(x)


def _reference(final: dict) -> torch.Tensor:
    model = build(seed=0)[0]
    model.load_state_dict(final["model"])
    return _outputs(model)


def test_torch_weights_only_into_a_fresh_model(trained: tuple[Path, dict], tmp_path: Path) -> None:
    store, final = trained
    out = tmp_path / "model.pt"
    result = runner.invoke(app, ["export", str(store), str(out), "--weights-only"])
    assert result.exit_code == 0, result.output
    assert "exported step 20" in result.stdout
    # In a process that never imports smartckpt: torch alone.
    code = (
        "import sys, torch; sd = torch.load(sys.argv[1], weights_only=True); "
        "print(sorted(sd)); assert 'smartckpt_cli' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sd = torch.load(out, weights_only=True)
    fresh = build(seed=123)[0]  # different initial weights
    assert not torch.equal(_outputs(fresh), _reference(final))
    fresh.load_state_dict(sd)
    assert torch.equal(_outputs(fresh), _reference(final))
    for key, value in final["model"].items():
        assert torch.equal(sd[key], value), key


def test_torch_full_state_restores_model_and_optimizer(trained: tuple[Path, dict], tmp_path: Path) -> None:
    store, final = trained
    out = tmp_path / "full.pt"
    assert runner.invoke(app, ["export", str(store), str(out)]).exit_code == 0
    state = torch.load(out, weights_only=True)
    assert set(state) == {"model", "optimizer", "scheduler", "rng", "data", "smartckpt"}
    assert state["smartckpt"]["step"] == 20
    model, opt, sched, _ = build(seed=5)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    assert torch.equal(_outputs(model), _reference(final))
    want = final["optimizer"]
    got = opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for pid, st in want["state"].items():
        for name, t in st.items():
            assert torch.equal(got["state"][pid][name], t), (pid, name)


def test_safetensors_weights_only_and_full(trained: tuple[Path, dict], tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    store, final = trained
    out = tmp_path / "model.safetensors"
    r = runner.invoke(app, ["export", str(store), str(out), "--format", "safetensors", "--weights-only"])
    assert r.exit_code == 0, r.output
    fresh = build(seed=9)[0]
    fresh.load_state_dict(safetensors.load_file(str(out)))
    assert torch.equal(_outputs(fresh), _reference(final))
    full = tmp_path / "full.safetensors"
    r = runner.invoke(app, ["export", str(store), str(full), "--format", "safetensors", "--step", "15"])
    assert r.exit_code == 0, r.output
    tensors = safetensors.load_file(str(full))
    assert "model/0.weight" in tensors and any(k.startswith("optimizer/state/") for k in tensors)
    from safetensors import safe_open

    with safe_open(str(full), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["smartckpt"])["step"] == 15
    groups = json.loads(meta["state"])["optimizer"]["param_groups"]
    assert groups[0]["weight_decay"] == 0.01


def test_export_never_overwrites_and_checks_its_input(trained: tuple[Path, dict], tmp_path: Path) -> None:
    store, _ = trained
    out = tmp_path / "taken.pt"
    out.write_bytes(b"precious")
    r = runner.invoke(app, ["export", str(store), str(out)])
    assert r.exit_code != 0 and "exists" in str(r.exception) and out.read_bytes() == b"precious"
    r = runner.invoke(app, ["export", str(store), str(tmp_path / "x.pt"), "--step", "3"])
    assert r.exit_code != 0 and "no checkpoint of step 3" in str(r.exception)
    r = runner.invoke(app, ["export", str(store), str(tmp_path / "x.pt"), "--format", "onnx"])
    assert r.exit_code == 2
    assert runner.invoke(app, ["export", str(store), str(out), "--force", "--weights-only"]).exit_code == 0
    assert out.read_bytes() != b"precious"
    assert [p.name for p in tmp_path.iterdir()] == ["taken.pt"], "no temporary file left behind"
