"""A tiny LlamaForCausalLM trained by ``transformers.Trainer`` (statesnap's or the stock one).

    python hf_train.py OUT --trainer statesnap|hf [--kill-at STEP] [--resume]

Writes OUT/losses[-resumed].json (step -> loss) and, at the end, OUT/final.pt (the parameters).
``--kill-at`` SIGKILLs the run right after that step's checkpoint began, once an earlier one is
committed; ``--resume`` trains with ``resume_from_checkpoint=True``. Built from a config, no
downloads; one thread, dropout off, a seeded shuffle: the Trainer is deterministic here.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from statesnap.integrations.transformers import StatesnapTrainer  # noqa: E402

STEPS, SAVE_EVERY = 10, 3


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=128):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    def __init__(self, out, kill_at):
        self.out, self.kill_at, self.losses = out, kill_at, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_save(self, args, state, control, **kwargs):
        if self.kill_at is not None and state.global_step == self.kill_at:
            deadline = time.monotonic() + 60  # an earlier checkpoint is committed: a resume has one
            while not [n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-")]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)  # with this step's checkpoint in flight


def model():
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", choices=["statesnap", "hf"], default="statesnap")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    training = TrainingArguments(output_dir=os.path.join(args.out, "run"), max_steps=STEPS, save_steps=SAVE_EVERY,
                                 save_total_limit=2, logging_steps=1, per_device_train_batch_size=4,
                                 learning_rate=3e-3, warmup_steps=2, seed=0, report_to=[], use_cpu=True,
                                 dataloader_num_workers=0, disable_tqdm=True)
    record = Record(args.out, args.kill_at)
    cls = StatesnapTrainer if args.trainer == "statesnap" else Trainer
    extra = {"statesnap_settings": {"host_memory_gb": 0.05}} if args.trainer == "statesnap" else {}
    trainer = cls(model=model(), args=training, train_dataset=Tokens(), callbacks=[record], **extra)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    with open(os.path.join(args.out, f"losses{'-resumed' if args.resume else ''}.json"), "w") as f:
        json.dump(record.losses, f)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    sys.exit(main())
