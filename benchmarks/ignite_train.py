"""The peer: the workload through PyTorch-Ignite, as its docs teach (Parallel, auto_*, an Engine).

    python benchmarks/ignite_train.py --out result.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def training(local_rank: int, args: argparse.Namespace) -> None:
    world = idist.get_world_size()
    # DDP over gloo, with hydraddp's DDP argument (auto_model passes it on), so the ratio measures the framework.
    model = idist.auto_model(workload.model(args.hidden), gradient_as_bucket_view=True)
    optimizer = idist.auto_optim(torch.optim.AdamW(model.parameters(), lr=workload.LR,
                                                   weight_decay=workload.WEIGHT_DECAY))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    # Ignite's auto_dataloader takes the global batch and gives each rank its share.
    loader = idist.auto_dataloader(workload.train_set(), batch_size=workload.BATCH_PER_RANK * world, shuffle=True,
                                   drop_last=True)

    def step(engine, batch):
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), workload.GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        return loss.detach()

    trainer = Engine(step)
    clock, last = workload.StepClock(args.steps), {"loss": float("nan")}

    @trainer.on(Events.EPOCH_STARTED)
    def new_shuffle(engine):  # ignite's Engine leaves this to the user (its docs and common.py do it so)
        loader.sampler.set_epoch(engine.state.epoch - 1)

    @trainer.on(Events.ITERATION_COMPLETED)
    def timing(engine):
        iteration = engine.state.iteration
        clock.step_done(iteration, engine.state.batch[0].shape[0] * world)
        if iteration % args.log_every == 0 or iteration == args.steps:
            last["loss"] = idist.all_reduce(engine.state.output.clone()).item() / world

    trainer.run(loader, max_iters=args.steps)
    steady = clock.steady_samples_per_s()
    peaks = idist.all_gather(workload.peak_rss_bytes())
    if idist.get_rank() == 0:
        workload.write_result(args.out, {"first_step_at": clock.first_step_at, "steady_samples_per_s": steady,
                                         "final_loss": last["loss"], "peak_memory_bytes": [int(p) for p in peaks]})


def main() -> None:
    args = workload.arguments(spawns_ranks=True).parse_args()
    with idist.Parallel(backend="gloo", nproc_per_node=args.nproc) as parallel:
        parallel.run(training, args)


if __name__ == "__main__":
    main()
