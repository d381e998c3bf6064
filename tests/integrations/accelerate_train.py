"""A small accelerate training loop on the CPU, checkpointed by ``AcceleratorCheckpoints``.

    python accelerate_train.py OUT [--kill-at STEP]

Resumes from the newest committed checkpoint under OUT/ckpt if there is one. Writes
OUT/losses-<start>.json (step -> loss for the steps this process ran) and OUT/final.pt. Dropout
is on (its masks come from the RNG states the checkpoint restores); one thread, fixed data.
"""
import argparse
import json
import os
import signal
import sys

import torch
import torch.nn as nn

torch.set_num_threads(1)

from accelerate import Accelerator  # noqa: E402

from statesnap.integrations.accelerate import AcceleratorCheckpoints  # noqa: E402

STEPS, SAVE_EVERY = 12, 4


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=STEPS)
    x = torch.randn(STEPS * 4, 16, generator=torch.Generator().manual_seed(1))
    # its own generator: making an iterator would otherwise draw from the RNG the checkpoint restores
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4,
                                       generator=torch.Generator())
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    checkpoints = AcceleratorCheckpoints(accelerator, os.path.join(args.out, "ckpt"), host_memory_gb=0.05)
    start = checkpoints.load_latest() or 0
    losses = {}
    for step, (inputs, target) in enumerate(accelerator.skip_first_batches(data, start), start + 1):
        loss = (model(inputs) - target).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if step % SAVE_EVERY == 0:
            handle = checkpoints.save(step)
            if step == args.kill_at:
                handle.wait()  # committed: the kill comes with the next save in flight
        if args.kill_at is not None and step == args.kill_at + 1:
            checkpoints.save(step)
            os.kill(os.getpid(), signal.SIGKILL)
    checkpoints.close()
    with open(os.path.join(args.out, f"losses-{start}.json"), "w") as f:
        json.dump({"losses": losses, "loaded_from": checkpoints.loaded_from}, f)
    torch.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
               os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    sys.exit(main())
