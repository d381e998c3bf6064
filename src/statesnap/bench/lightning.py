"""Lightning: stall and end-to-end overhead of checkpointing, statesnap against Lightning's own.

One process trains an MLP (``--width`` × ``--layers`` Linear layers, AdamW) for ``--steps`` steps
with ``ModelCheckpoint(every_n_train_steps=--every, save_last=True)``, four ways, interleaved
over ``--repeat`` rounds: no checkpointing, Lightning's default ``TorchCheckpointIO`` (torch.save),
its ``AsyncCheckpointIO`` (clones the tensors on the training thread, writes in a thread), and
``StatesnapCheckpointIO``. For each:

* ``fit_s``: ``trainer.fit`` wall time; the overhead is against the run without checkpoints;
* blocked and stall per checkpoint, as ``bench/trainer_runs.py`` defines them: the time the
  training thread spends in ``save_checkpoint`` plus, for statesnap, the optimizer's wait for the
  snapshot copy; and that call plus what the step after it takes beyond the median step of the
  run without checkpoints (the background work on the same cores counted in).

The last checkpoint of every run is loaded back and compared bit for bit with the model.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from .common import DEFAULT_OUT, DEFAULT_THREADS, fresh_dir, positive_int, publish, remove_scratch
from .trainer_runs import add_run_arguments, interleaved, optimizer_wait_s, summarize, table

MODES = ("none", "torch", "async", "statesnap")


def _run(mode: str, out: str, args) -> dict:
    import lightning.pytorch as pl
    import torch.nn as nn
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from ..integrations.lightning import StatesnapCheckpointIO

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])

        def training_step(self, batch, batch_idx):
            return self.layers(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timed(ModelCheckpoint):
        def _save_checkpoint(self, trainer, filepath):
            start = time.perf_counter()
            super()._save_checkpoint(trainer, filepath)
            clock.saves.append((trainer.global_step, time.perf_counter() - start))
            if mode == "statesnap":
                checkpointers.update(store.ckpt for store in plugins[0]._stores.values())

    class Clock(pl.Callback):
        def __init__(self):
            self.steps, self.saves, self._start = {}, [], None

        def on_train_batch_start(self, trainer, *rest):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, *rest):
            self.steps[trainer.global_step] = time.perf_counter() - self._start

    clock, checkpointers = Clock(), set()
    directory = fresh_dir(os.path.join(out, mode))
    callbacks = [clock]
    if mode != "none":
        callbacks.insert(0, Timed(dirpath=directory, every_n_train_steps=args.every, save_last=True, save_top_k=-1))
    plugins = {"none": [], "torch": [], "async": [AsyncCheckpointIO()],
               "statesnap": [StatesnapCheckpointIO(durable=args.durable)]}[mode]
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(args.steps * 16, args.width)),
                                       batch_size=16)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, plugins=plugins, callbacks=callbacks,
                         enable_checkpointing=mode != "none", logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Net()
    start = time.perf_counter()
    trainer.fit(model, data)
    fit_s = time.perf_counter() - start
    if mode != "none":
        _check_last(directory, model, plugins)
    remove_scratch(directory)
    return {"fit_s": fit_s, "steps": clock.steps, "saves": clock.saves,
            "optimizer_wait_s": optimizer_wait_s(checkpointers)}


def _check_last(directory: str, model, plugins) -> None:
    from ..integrations.lightning import StatesnapCheckpointIO

    path = os.path.join(directory, "last.ckpt")
    io = plugins[0] if plugins and isinstance(plugins[0], StatesnapCheckpointIO) else None
    stored = io.load_checkpoint(path) if io else torch.load(path, weights_only=True)
    for name, value in model.state_dict().items():
        if not torch.equal(stored["state_dict"][name], value):
            raise RuntimeError(f"the last checkpoint differs from the model in {name}")


def run(steps: int = 40, every: int = 5, width: int = 1024, layers: int = 8, repeat: int = 3,
        durable: bool = True, out: str = DEFAULT_OUT,
        threads: int = DEFAULT_THREADS) -> dict:
    torch.set_num_threads(threads)
    import lightning.pytorch  # noqa: F401 (it sets its loggers' levels when imported)

    for name in ("lightning.pytorch", "lightning.fabric"):  # its banners would mix into the report
        logging.getLogger(name).setLevel(logging.WARNING)
    scratch = fresh_dir(os.path.join(out, "lightning"))
    args = argparse.Namespace(steps=steps, every=every, width=width, layers=layers, durable=durable)
    try:
        runs = interleaved(MODES, lambda mode: _run(mode, scratch, args), repeat)
    finally:
        remove_scratch(scratch)
    state_mb = 3 * layers * (width * width + width) * 4 / 1e6  # weights and two AdamW moments
    return {"steps": steps, "every": every, "checkpoints": steps // every, "state_mb": state_mb, "repeat": repeat,
            "durable": durable, "threads": threads, **summarize(runs)}


def report(result: dict) -> str:
    labels = {"torch": "TorchCheckpointIO (default)", "async": "AsyncCheckpointIO", "statesnap": "StatesnapCheckpointIO"}
    return (f"Lightning, 1 process, {result['threads']} torch threads: {result['steps']} steps of "
            f"{result['step_s'] * 1e3:.1f} ms, a checkpoint every {result['every']} ({result['checkpoints']} + last), "
            f"{result['state_mb']:.0f} MB of weights and AdamW state, medians of {result['repeat']} interleaved "
            "rounds\n" + table(result, labels, "torch"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite lightning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--every", type=positive_int, default=5, help="checkpoint every this many steps")
    parser.add_argument("--width", type=positive_int, default=1024)
    parser.add_argument("--layers", type=positive_int, default=8)
    add_run_arguments(parser, "statesnap without fsync (torch.save does not fsync either)")
    args = parser.parse_args(argv)
    result = run(args.steps, args.every, args.width, args.layers, args.repeat, args.durable, args.out, args.threads)
    publish(result, report(result), args.json)
    return 0
