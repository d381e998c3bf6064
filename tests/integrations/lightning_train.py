"""A small Lightning run, checkpointed by statesnap (or Lightning's default), killable mid-way.

    python lightning_train.py OUT --devices 1|2 --io statesnap|torch [--fsdp] [--kill-at STEP] [--resume]

Writes OUT/losses-<rank>.json (global step -> loss, for the steps this process ran), OUT/start.pt
(the state the run started from) and, at the end, OUT/final-<rank>.pt (the parameters).
``--kill-at`` SIGKILLs the whole run (every rank) at that global step, with a save in flight;
``--resume`` fits with ``ckpt_path="last"``.
Deterministic: one thread, fixed data, no shuffle, no dropout.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.nn as nn

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from statesnap.integrations.lightning import StatesnapCheckpointIO, StatesnapModelParallelStrategy  # noqa: E402

STEPS_PER_EPOCH, EPOCHS = 4, 3


class Net(pl.LightningModule):
    def __init__(self, width: int = 32):
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))

    def configure_model(self):
        if self._trainer is None:  # built by load_from_checkpoint: nothing to shard for
            return
        if isinstance(self.trainer.strategy, StatesnapModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.layers(x) - y).pow(2).mean()
        self.log("train_loss", loss)
        self.trainer.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        world = self.trainer.world_size
        x = torch.randn(STEPS_PER_EPOCH * 8 * world, 32, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


class DumpStart(pl.Callback):
    """The whole state right after a resume restored it: parameters and Adam moments by name."""

    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, module):
        optimizer = trainer.optimizers[0]
        names = {p: n for n, p in module.named_parameters()}
        state = {f"param.{n}": full(p) for p, n in names.items()}
        state.update({f"exp_avg.{names[p]}": full(optimizer.state[p]["exp_avg"])
                      for p in names if p in optimizer.state})
        if trainer.global_rank == 0:
            torch.save(state, os.path.join(self.out, "start.pt"))


class KillAt(pl.Callback):
    """SIGKILLs the whole run at a global step, right after that step's save began (it runs
    after ModelCheckpoint), once an earlier save has committed: so a resume always has a
    checkpoint, and one more is in flight when the run dies."""

    def __init__(self, step, directory):
        self.step, self.directory = step, directory

    def on_train_batch_end(self, trainer, *args):
        if self.step is None or trainer.global_step != self.step:
            return
        if trainer.global_rank == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(self.directory, "last.ckpt")) and time.monotonic() < deadline:
                time.sleep(0.01)
        trainer.strategy.barrier()  # every rank got here: the run dies as a whole
        os.killpg(os.getpgid(0), signal.SIGKILL)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--io", choices=["statesnap", "torch"], default="statesnap")
    parser.add_argument("--fsdp", action="store_true", help="StatesnapModelParallelStrategy (FSDP2)")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(0, workers=True)
    # saves at the epochs' ends: Lightning resumes a plain DataLoader exactly only from there
    checkpoints = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=STEPS_PER_EPOCH,
                                  save_last=True, monitor="train_loss", save_top_k=2)
    plugins = [StatesnapCheckpointIO(host_memory_gb=0.05)] if args.io == "statesnap" and not args.fsdp else []
    strategy = pl.strategies.DDPStrategy(process_group_backend="gloo") if args.devices > 1 else "auto"
    if args.fsdp:
        strategy = StatesnapModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1,
                                                  process_group_backend="gloo",
                                                  checkpoint_io=StatesnapCheckpointIO(host_memory_gb=0.05))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=EPOCHS,
                         plugins=plugins, logger=False,
                         callbacks=[checkpoints, KillAt(args.kill_at, checkpoints.dirpath), DumpStart(args.out)],
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                         log_every_n_steps=1)
    trainer.losses = {}
    model = Net()
    trainer.fit(model, datamodule=Data(), ckpt_path="last" if args.resume else None)
    rank = trainer.global_rank
    with open(os.path.join(args.out, f"losses-{rank}{'-resumed' if args.resume else ''}.json"), "w") as f:
        json.dump(trainer.losses, f)
    torch.save({k: full(v) for k, v in model.state_dict().items()}, os.path.join(args.out, f"final-{rank}.pt"))
    if rank == 0:
        names = sorted(n for n in os.listdir(checkpoints.dirpath) if n.endswith(".ckpt"))
        with open(os.path.join(args.out, "checkpoints.json"), "w") as f:
            json.dump({"files": names, "best": os.path.basename(checkpoints.best_model_path),
                       "kth": sorted(os.path.basename(p) for p in checkpoints.best_k_models)}, f)
    if args.devices > 1:  # every rank's files are written: out together, before gloo's teardown at exit can
        from statesnap.bench.teardown import leave_together  # abort a rank whose peer left first (exit -6)

        leave_together()


if __name__ == "__main__":
    sys.exit(main())
