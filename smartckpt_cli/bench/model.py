"""What ``smartckpt bench`` and the scripts in ``benchmarks/`` train: an MLP of a given size with
AdamW state (:func:`build_model`), one training step on it (:func:`train_step`), the device to
run on (:func:`resolve_device`) and the defaults per device. Imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from smartckpt_cli.errors import ConfigError

__all__ = ["DEFAULT_BATCH", "DEFAULT_PARAMS", "build_model", "resolve_device", "state_tensors", "train_step"]

# Defaults per device: the CPU bench keeps the figures the README has always shown; on a GPU
# ~5 GB of state (the size the targets are stated for) and a batch whose step takes a
# large fraction of a second on an H200, as in a real fine-tune of such a model.
DEFAULT_PARAMS = {"cpu": 100_000_000, "cuda": 400_000_000}
DEFAULT_BATCH = {"cpu": 8, "cuda": 4096}


def resolve_device(name: str | None) -> torch.device:
    """``cpu`` or ``cuda`` (None: CUDA when torch sees a device); a clear error otherwise."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, not {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device here; use --device cpu"
        )
    return torch.device(name)


def build_model(
    params: int, *, width: int = 4096, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of about ``params`` parameters on ``device``, with AdamW state after one real step."""
    width = min(width, max(64, int((params / 4) ** 0.5)))
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt)
    return model, opt


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: int = 8,
    before_update: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One forward/backward/AdamW step on a random batch made on the model's device; returns
    the loss, left on the device. ``before_update`` runs between backward and the update."""
    p = next(model.parameters())
    loss = model(torch.randn(batch, p.shape[1], device=p.device)).pow(2).mean()
    loss.backward()
    if before_update is not None:
        before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


_train_step = train_step  # the name benchmarks/ scripts used before


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the model's and the optimizer's state (what a checkpoint of them holds)."""
    return [*model.state_dict().values()] + [
        t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
