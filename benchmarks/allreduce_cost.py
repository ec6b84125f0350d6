"""What one DDP gradient allreduce of the benchmark MLP costs on this machine, alone (the scaling ceiling).

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/allreduce_cost.py [--hidden 1024 1024 ...] [--out cost.json]

With two ranks on two cores, no core is free for the allreduce to hide behind: a step costs its compute plus the
allreduce's CPU time, so 2-rank DDP can reach at most t_step / (t_step + t_allreduce_cpu) of twice one rank's rate.
benchmarks/run.py measures this in every round and reports each scaling figure against that ceiling.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, nargs="+", default=list(workload.HIDDEN))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    numel = sum(p.numel() for p in workload.model(args.hidden).parameters())
    grads = torch.randn(numel)
    for _ in range(5):
        dist.all_reduce(grads)
    dist.barrier()
    began, cpu_began, reps = time.perf_counter(), time.process_time(), 50
    for _ in range(reps):
        dist.all_reduce(grads)
    wall, cpu = (time.perf_counter() - began) / reps, (time.process_time() - cpu_began) / reps
    if dist.get_rank() == 0:
        print(f"{numel:,} fp32 gradients ({numel * 4 / 2**20:.1f} MiB): one allreduce takes {wall * 1e3:.2f} ms "
              f"and {cpu * 1e3:.2f} ms of this rank's CPU")
        if args.out:
            workload.write_result(args.out, {"numel": numel, "wall_s": wall, "cpu_s": cpu})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see plain_torchrun.py: skip interpreter finalization after the group is gone
