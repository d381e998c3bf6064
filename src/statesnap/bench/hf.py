"""Hugging Face Trainer: stall and end-to-end overhead of checkpointing, statesnap against the Trainer's own.

One process trains a LlamaForCausalLM built from a config (``--hidden``, ``--layers``, vocab
8192; no downloads) for ``--steps`` steps with ``save_steps=--every``, three ways, interleaved over
``--repeat`` rounds: no checkpoints, the stock ``Trainer`` (safetensors model, ``torch.save`` of
the optimizer, scheduler and RNG states, blocking) and ``StatesnapTrainer``. Stall and overhead as
in ``bench/trainer_runs.py``. The last checkpoint of every run is loaded back and compared bit for
bit with the trained model.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from .common import DEFAULT_OUT, DEFAULT_THREADS, fresh_dir, positive_int, publish, remove_scratch
from .trainer_runs import add_run_arguments, interleaved, optimizer_wait_s, summarize, table

MODES = ("none", "hf", "statesnap")


def _run(mode: str, out: str, args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from ..integrations.transformers import StatesnapTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.steps, self._start = {}, None

        def on_step_begin(self, *rest, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, training_args, state, *rest, **kwargs):
            self.steps[state.global_step] = time.perf_counter() - self._start

    config = LlamaConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 8192, (args.steps * 4, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    directory = fresh_dir(os.path.join(out, mode))
    training = TrainingArguments(output_dir=directory, max_steps=args.steps, per_device_train_batch_size=4,
                                 save_strategy="no" if mode == "none" else "steps", save_steps=args.every,
                                 report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
    clock = Clock()
    cls = StatesnapTrainer if mode == "statesnap" else Trainer
    extra = {"statesnap_settings": {"durable": args.durable}} if mode == "statesnap" else {}
    trainer = cls(model=model, args=training, train_dataset=data, callbacks=[clock], **extra)
    saves, checkpointers = [], set()
    save = trainer._save_checkpoint

    def timed_save(*a, **k):
        start = time.perf_counter()
        save(*a, **k)
        saves.append((trainer.state.global_step, time.perf_counter() - start))
        checkpointers.update(getattr(trainer, "_checkpointers", {}).values())
    trainer._save_checkpoint = timed_save
    start = time.perf_counter()
    trainer.train()
    fit_s = time.perf_counter() - start
    if mode != "none":
        _check_last(trainer, directory, mode)
    remove_scratch(directory)
    return {"fit_s": fit_s, "steps": clock.steps, "saves": saves, "optimizer_wait_s": optimizer_wait_s(checkpointers)}


def _check_last(trainer, directory: str, mode: str) -> None:
    from safetensors.torch import load_file

    from ..engine.load import load
    from ..integrations.transformers import pointer_target

    last = os.path.join(directory, f"checkpoint-{trainer.state.global_step}")
    expected = trainer.model.state_dict()
    if mode == "statesnap":
        stored = {k: torch.empty_like(v) for k, v in expected.items()}
        load({"model": stored}, pointer_target(last), strict=False)
    else:
        stored = load_file(os.path.join(last, "model.safetensors"))
    for name, value in expected.items():
        if name in stored and not torch.equal(stored[name], value):
            raise RuntimeError(f"the last checkpoint differs from the model in {name}")


def run(steps: int = 30, every: int = 5, hidden: int = 384, layers: int = 6, repeat: int = 3,
        durable: bool = True, out: str = DEFAULT_OUT,
        threads: int = DEFAULT_THREADS) -> dict:
    torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    scratch = fresh_dir(os.path.join(out, "hf"))
    args = argparse.Namespace(steps=steps, every=every, hidden=hidden, layers=layers, durable=durable)
    try:
        runs = interleaved(MODES, lambda mode: _run(mode, scratch, args), repeat)
    finally:
        remove_scratch(scratch)
    return {"steps": steps, "every": every, "checkpoints": steps // every, "hidden": hidden, "layers": layers,
            "repeat": repeat, "durable": durable, "threads": threads, **summarize(runs)}


def report(result: dict) -> str:
    labels = {"hf": "Trainer (default)", "statesnap": "StatesnapTrainer"}
    return (f"Hugging Face Trainer, 1 process, {result['threads']} torch threads: LlamaForCausalLM hidden "
            f"{result['hidden']} x {result['layers']} layers, {result['steps']} steps of "
            f"{result['step_s'] * 1e3:.1f} ms, a checkpoint every "
            f"{result['every']}, medians of {result['repeat']} interleaved rounds\n" + table(result, labels, "hf"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--every", type=positive_int, default=5, help="save_steps")
    parser.add_argument("--hidden", type=positive_int, default=384)
    parser.add_argument("--layers", type=positive_int, default=6)
    add_run_arguments(parser, "statesnap without fsync")
    args = parser.parse_args(argv)
    result = run(args.steps, args.every, args.hidden, args.layers, args.repeat, args.durable, args.out, args.threads)
    publish(result, report(result), args.json)
    return 0
