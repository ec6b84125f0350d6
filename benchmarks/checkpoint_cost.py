"""What periodic checkpoints cost a training run: steady samples/s with a checkpoint every 20 steps, written in the
background (``checkpoint.async_save=true``, the default) and at once (``false``), each divided by the same launch
without checkpoints.

    .venv/bin/python benchmarks/checkpoint_cost.py [--rounds 3] [--steps 100] [--out checkpoint_cost.json]

One run of this script: the three launches (a GPT under fsdp2 on 2 gloo ranks, untracked, evaluation only at the end)
interleaved, ``--rounds`` times; each ratio is the median over the rounds of that round's ratio. The last step's
checkpoint is not taken (``save_last=false``, and no periodic step is the last), so every checkpoint counted is a
periodic one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = ["model=gpt", "data=text", "task=causal_lm", "wrap=fsdp2", "backend=gloo", "launcher.nproc_per_node=2",
        "model.dim=256", "model.depth=6", "model.heads=4", "trainer.eval_every=0", "trainer.log_every=10",
        "tracking.enabled=false", "plan.record=false"]
MODES = {"none": ["checkpoint.every_n_steps=0"],
         "sync": ["checkpoint.every_n_steps=20", "checkpoint.async_save=false"],
         "async": ["checkpoint.every_n_steps=20", "checkpoint.async_save=true"]}


def steady(mode: str, steps: int, root: Path, round_: int) -> float:
    job = root / f"{mode}-{round_}"
    done = subprocess.run([sys.executable, "-m", "hydraddp", *BASE, f"trainer.max_steps={steps + 1}", *MODES[mode],
                           f"hydra.run.dir={job}"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads((job / "result.json").read_text())["steady_samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            rates = {mode: steady(mode, args.steps, Path(tmp), round_) for mode in MODES}
            rounds.append(rates)
            print(f"round {round_ + 1}: " + ", ".join(f"{m} {r:.1f} samples/s" for m, r in rates.items()), flush=True)
    ratios = {f"{mode} / none": statistics.median(r[mode] / r["none"] for r in rounds) for mode in ("sync", "async")}
    for name, value in ratios.items():
        print(f"{name}: {value:.3f} (median of {args.rounds} rounds)")
    if args.out:
        args.out.write_text(json.dumps({"rounds": rounds, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
