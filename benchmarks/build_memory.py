"""What building a model costs each rank in host memory before its first step: built on the meta device and filled
after sharding (``model.init_device=auto`` under fsdp2) against built whole on every rank (``cpu``).

    .venv/bin/python benchmarks/build_memory.py [--nproc 4] [--dim 1024 --depth 32 --heads 16]

Three launches of ``python -m hydraddp`` (fsdp2 on gloo, one step, untracked): a tiny GPT (what the process costs
without the model), then the large one with each ``model.init_device``. Each rank's ``build_peak_memory_bytes`` (its
peak RSS when training begins, in ``result.json``) above the tiny launch's, as a fraction of the model's fp32 bytes.
Memory, not time: the figures do not depend on how busy the machine is. About 8 minutes on 2 cores for 403M.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT = ["model=gpt", "data=text", "task=causal_lm", "wrap=fsdp2", "backend=gloo", "trainer.max_steps=1",
       "trainer.eval_every=0", "tracking.enabled=false", "plan.record=false"]


def build_peaks(nproc: int, overrides: list[str], root: Path) -> list[int]:
    job = root / "-".join(o.split("=")[-1] for o in overrides)
    done = subprocess.run([sys.executable, "-m", "hydraddp", *GPT, f"launcher.nproc_per_node={nproc}", *overrides,
                           f"hydra.run.dir={job}"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"launch {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads((job / "result.json").read_text())["build_peak_memory_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    from hydraddp.models.gpt import GPT as Model

    import torch

    with torch.device("meta"):
        model_bytes = sum(p.numel() * 4 for p in Model(dim=args.dim, depth=args.depth, heads=args.heads).parameters())
    size = [f"model.dim={args.dim}", f"model.depth={args.depth}", f"model.heads={args.heads}"]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_peaks(args.nproc, ["model.init_device=auto"], Path(tmp))
        rows = {device: build_peaks(args.nproc, [*size, f"model.init_device={device}"], Path(tmp))
                for device in ("auto", "cpu")}
    print(f"GPT {model_bytes / 4e6:.0f}M parameters, {model_bytes / 1e9:.2f} GB fp32, fsdp2 on {args.nproc} gloo ranks")
    print(f"tiny GPT's build peak per rank (GB): {[round(b / 1e9, 3) for b in tiny]}")
    for device, peaks in rows.items():
        above = [(p - t) / model_bytes for p, t in zip(peaks, tiny)]
        print(f"init_device={device:<4}  build peak per rank (GB): {[round(b / 1e9, 3) for b in peaks]}  "
              f"above the tiny one / model bytes: max {max(above):.2f}")


if __name__ == "__main__":
    main()
