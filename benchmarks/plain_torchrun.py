"""The floor: the workload as a plain script, as people write it for torchrun.

    torchrun --nproc_per_node 2 benchmarks/plain_torchrun.py --wrap ddp --out result.json
    OMP_NUM_THREADS=1 python benchmarks/plain_torchrun.py --wrap none --out result.json   # one process

``--units linear`` puts one ``fully_shard`` on every Linear (then the root), the usual hand-written FSDP2;
``--units root`` one ``fully_shard`` on the whole model; ``--units blocks`` one on each decoder layer (``--model hf``).
``--bucket-view`` is hydraddp's DDP argument (``gradient_as_bucket_view=True``): with it the two run the same DDP.
``--model hf`` trains the Hugging Face Llama of workload.HF_SIZES on token dicts instead of the MLP on the digits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def main() -> None:
    parser = workload.arguments()
    parser.add_argument("--wrap", choices=["none", "ddp", "fsdp2"], default="ddp")
    parser.add_argument("--units", choices=["root", "linear", "blocks"], default="root")
    parser.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True), as hydraddp")
    parser.add_argument("--model", choices=["mlp", "hf"], default="mlp")
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    hf = args.model == "hf"
    model = workload.hf_model() if hf else workload.model(args.hidden)
    if args.wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=args.bucket_view)
    elif args.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if args.units == "linear":
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
        if args.units == "blocks":
            for layer in model.model.layers:
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.LR, weight_decay=workload.WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    data = workload.hf_train_set() if hf else workload.train_set()
    batch_per_rank = workload.HF_BATCH_PER_RANK if hf else workload.BATCH_PER_RANK
    # One process reads the same order as hydraddp's one process: a one-replica DistributedSampler (a RandomSampler
    # drew another order, which trained to other losses at another speed: not the same work).
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=workload.SEED, drop_last=True)
    loader = DataLoader(data, batch_size=batch_per_rank, sampler=sampler, drop_last=True)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    clock, loss_value = workload.StepClock(args.steps), float("nan")
    stream = batches()
    for step in range(1, args.steps + 1):
        batch = next(stream)
        if hf:
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            samples = batch["input_ids"].shape[0]
        else:
            inputs, targets = batch
            loss = F.cross_entropy(model(inputs), targets)
            samples = inputs.shape[0]
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), workload.GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        clock.step_done(step, samples * world)
        if step % args.log_every == 0 or step == args.steps:
            mean = loss.detach().clone()
            if distributed:
                dist.all_reduce(mean)
                mean /= world
            loss_value = mean.item()
    steady = clock.steady_samples_per_s()
    peaks = [workload.peak_rss_bytes()]
    if distributed:
        gathered = [None] * world
        dist.all_gather_object(gathered, peaks[0])
        peaks = gathered
        dist.barrier()  # no rank tears the group down while a peer still talks to it
        dist.destroy_process_group()
    if rank == 0:
        workload.write_result(args.out, {"first_step_at": clock.first_step_at, "steady_samples_per_s": steady,
                                         "final_loss": loss_value, "peak_memory_bytes": peaks})


if __name__ == "__main__":
    main()
    # torch 2.13 + gloo + FSDP2: about one exit in six aborts in interpreter finalization ("terminate called
    # without an active exception") after destroy_process_group. Everything is done and written: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
