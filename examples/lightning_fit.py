"""A Lightning ``fit`` checkpointed by smartckpt: the trigger decides when to save, the state
(module, optimizers, LR schedulers, RNG, Lightning's loop progress and a ``StatefulDataLoader``'s
position) goes into smartckpt's store, and Lightning writes no ``.ckpt`` files of its own. Run it
again after an interruption and it resumes at the right global step.

Under SLURM with Lightning's auto-requeue, smartckpt takes its blocking checkpoint on the requeue
signal and then hands the signal on to Lightning, which requeues the job as usual.

    pip install 'smartckpt[lightning]' torchdata
    python examples/lightning_fit.py --dir ./checkpoints --max-steps 300
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

try:
    import pytorch_lightning as pl
except ImportError:  # the unified `lightning` package
    import lightning.pytorch as pl

from smartckpt_cli.integrations.lightning import SmartCheckpointCallback


class Regressor(pl.LightningModule):
    def __init__(self, total_steps: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
        )
        self.total_steps = total_steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(2048, 16, generator=g)
    ys = (xs @ torch.randn(16, 1, generator=g)).tanh()
    data = torch.utils.data.TensorDataset(xs, ys)
    try:  # a StatefulDataLoader resumes mid-epoch at the exact next batch
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(
            data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
    except ImportError:
        return torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="checkpoints", help="smartckpt's checkpoint store")
    p.add_argument("--out", default="lightning_output", help="Lightning's default_root_dir")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--every", type=int, default=None, help="also save every N steps")
    args = p.parse_args()

    torch.manual_seed(0)
    smartckpt = SmartCheckpointCallback(args.dir, keep_last=3, every_steps=args.every)
    trainer = pl.Trainer(
        max_steps=args.max_steps, default_root_dir=args.out, accelerator="cpu", devices=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[smartckpt],
    )  # fmt: skip
    trainer.fit(Regressor(args.max_steps), loader())
    print(f"resumed from step {smartckpt.restored_step}", flush=True)
    print(f"finished at global step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
