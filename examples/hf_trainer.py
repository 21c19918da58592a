"""Hugging Face ``Trainer`` checkpointed by smartckpt: the trigger decides when to save, the state
(weights, optimizer, LR scheduler, RNG, data position, TrainerState) goes into smartckpt's store,
and the Trainer writes no ``checkpoint-*`` folders of its own. Run it again after an interruption
and it resumes at the right global step; it finishes at ``max_steps``, no step more or less.

A tiny BERT classifier built from a config and random token data: nothing is downloaded.

    pip install 'smartckpt[hf]'
    python examples/hf_trainer.py --dir ./checkpoints --max-steps 200

Under ``smartckpt run`` the callback is added to every Trainer by itself, so the two lines marked
below are optional there.
"""

from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from smartckpt_cli.integrations.hf import SmartCheckpointCallback


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random token ids; the label is whether the first token is above the middle."""

    def __init__(self, n: int = 512, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 100, (n, length), generator=g)
        self.labels = (self.ids[:, 0] > 52).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="checkpoints", help="smartckpt's checkpoint store")
    p.add_argument("--out", default="hf_output", help="the Trainer's output_dir (logs)")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--every", type=int, default=None, help="also save every N steps")
    args = p.parse_args()

    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=16,
        learning_rate=1e-3, warmup_steps=10, logging_steps=20, report_to=[], seed=0, use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens())
    # smartckpt: attach the callback (it resumes inside train() when the store has a checkpoint).
    smartckpt = SmartCheckpointCallback(args.dir, keep_last=3, every_steps=args.every).attach(trainer)
    trainer.train()
    print(f"resumed from step {smartckpt.restored_step}", flush=True)
    print(f"finished at global step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
