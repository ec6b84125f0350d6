"""The floor on a GPU machine: hydraddp's GPT workload written by hand for torchrun, bf16.

    torchrun --nproc_per_node $(nvidia-smi -L | wc -l) benchmarks/plain_gpt.py --wrap fsdp2 --out result.json

DDP computes under bf16 autocast; FSDP2 puts one ``fully_shard`` on every GPTBlock, then the root, with
bf16 parameters and fp32 gradient reduction: what hydraddp's precision=bf16 does for each wrap.
"""

from __future__ import annotations

import argparse
import contextlib
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from hydraddp.data.text import text
    from hydraddp.models.gpt import GPT

    shape = workload.GPT_SHAPE
    dist.init_process_group("nccl")
    rank, world, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.manual_seed(workload.SEED)
    model = GPT(vocab_size=128, seq_len=shape["seq_len"], dim=shape["dim"], depth=shape["depth"],
                heads=shape["heads"]).to(device)
    flops_per_token = model.flops_per_token()
    autocast = contextlib.nullcontext()
    if args.wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        for block in model.blocks.values():
            fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                          output_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.LR, weight_decay=workload.WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    data = text(seq_len=shape["seq_len"], num_chars=shape["num_chars"], seed=0)[0]
    sampler = DistributedSampler(data, shuffle=True, seed=workload.SEED, drop_last=True)
    loader = DataLoader(data, batch_size=shape["batch_per_gpu"], sampler=sampler, drop_last=True)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    clock = workload.StepClock(args.steps)
    stream = batches()
    for step in range(1, args.steps + 1):
        inputs, targets = (t.to(device, non_blocking=True) for t in next(stream))
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), workload.GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        clock.step_done(step, inputs.shape[0] * world)
        if step % args.log_every == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean.item()
    steady = clock.steady_samples_per_s()
    peak = torch.cuda.max_memory_allocated(device)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    dist.barrier()  # no rank tears the group down while a peer still talks to it
    dist.destroy_process_group()
    if rank == 0:
        workload.write_result(args.out, {"first_step_at": clock.first_step_at, "steady_samples_per_s": steady,
                                         "final_loss": float("nan"), "peak_memory_bytes": peaks,
                                         "flops_per_token": flops_per_token})


if __name__ == "__main__":
    main()
