"""The peer: the workload through Lightning Fabric, as its docs teach (Fabric, launch, setup, backward).

    python benchmarks/fabric_train.py --nproc 2 --out result.json

Fabric's DDP strategy gets the DDP arguments hydraddp uses (``gradient_as_bucket_view``), so the ratio measures
the framework, not a setting.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import DDPStrategy
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def training(fabric: Fabric, args: argparse.Namespace) -> None:
    world = fabric.world_size
    model = workload.model(args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.LR, weight_decay=workload.WEIGHT_DECAY)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    # Fabric swaps in a DistributedSampler (seed 0, as the plain script's); the epoch is the user's to set.
    loader = fabric.setup_dataloaders(DataLoader(workload.train_set(), batch_size=workload.BATCH_PER_RANK,
                                                 shuffle=True, drop_last=True))
    clock, loss_value, step, epoch = workload.StepClock(args.steps), float("nan"), 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            step += 1
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=workload.GRAD_CLIP)
            optimizer.step()
            scheduler.step()
            clock.step_done(step, inputs.shape[0] * world)
            if step % args.log_every == 0 or step == args.steps:
                loss_value = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
            if step == args.steps:
                break
        epoch += 1
    steady = clock.steady_samples_per_s()
    peaks = fabric.all_gather(torch.tensor(workload.peak_rss_bytes())).reshape(-1).tolist()
    if fabric.global_rank == 0:
        workload.write_result(args.out, {"first_step_at": clock.first_step_at, "steady_samples_per_s": steady,
                                         "final_loss": loss_value, "peak_memory_bytes": [int(p) for p in peaks]})


def main() -> None:
    args = workload.arguments(spawns_ranks=True).parse_args()
    strategy = DDPStrategy(process_group_backend="gloo", gradient_as_bucket_view=True)
    fabric = Fabric(accelerator="cpu", devices=args.nproc, strategy=strategy, precision="32-true")
    fabric.launch(training, args)


if __name__ == "__main__":
    main()
    # As benchmarks/plain_torchrun.py: torch 2.13's gloo group can abort in interpreter finalization ("terminate
    # called without an active exception", exit -6; once in CI beside other launches). Every rank ran
    # ``fabric.launch`` to its end, and rank 0 wrote the result: skip finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
