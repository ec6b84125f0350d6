"""A short tour of the core: the same training under ddp, fsdp and fsdp2 on 2 CPU processes (gloo).

    python -m hydraddp.demo [--nproc 2] [--steps 30]

Prints, per wrap, the final loss, the FSDP units, and each rank's param/grad/optimizer bytes as the
WrapReport measured them.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hydraddp.distributed as idist

WRAPS = ("ddp", "fsdp", "fsdp2")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    return TensorDataset(x, (x[:, :10].argmax(dim=1)))  # a learnable rule, so the loss really falls


def train(local_rank: int, steps: int) -> dict[str, dict]:
    results = {}
    for wrap in WRAPS:
        sharding = {"min_num_params": 20_000} if wrap != "ddp" else {}  # FSDP: a unit per large Linear
        model = idist.auto_model(_model(), wrap=wrap, **sharding)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = idist.auto_dataloader(_data(), batch_size=128)
        start, seen, losses = time.perf_counter(), 0, []
        for step, (x, y) in zip(range(steps), loader):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += x.shape[0] * idist.get_world_size()
            losses.append(idist.all_reduce(loss.item()) / idist.get_world_size())
        reports = idist.wrap_report(model, optimizer).gather()
        results[wrap] = {"first_loss": losses[0], "final_loss": losses[-1], "reports": [r.to_dict() for r in reports],
                         "samples_per_s": seen / (time.perf_counter() - start)}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    results = idist.Parallel(backend="gloo", nproc_per_node=args.nproc).run(train, args.steps)[0]
    print(f"\n{'wrap':6} {'loss first→final':>17} {'samples/s':>10}  {'per-rank param+grad+optim bytes':>32}  units")
    for wrap, out in results.items():
        per_rank = [r["param_bytes"] + r["grad_bytes"] + r["optim_state_bytes"] for r in out["reports"]]
        print(f"{wrap:6} {out['first_loss']:7.3f} → {out['final_loss']:6.3f} {out['samples_per_s']:10.0f}  "
              f"{' / '.join(f'{b:,}' for b in per_rank):>32}  {', '.join(out['reports'][0]['units'])}")


if __name__ == "__main__":
    main()
