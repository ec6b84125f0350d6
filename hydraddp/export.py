"""python -m hydraddp.export CHECKPOINT OUT.pt: a checkpoint's model as one plain state_dict file.

The file loads with ``torch.load(OUT, weights_only=True)`` into the unwrapped model that the checkpoint's
own config builds, whatever wrap mode and world size wrote it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from hydraddp.config.instantiate import instantiate, model_kwargs
from hydraddp.train.checkpoint import CheckpointError, check_matches, read_meta, reader


def export(checkpoint: Path, out: Path) -> Path:
    if not checkpoint.exists():
        raise CheckpointError(f"{checkpoint}: no such checkpoint. Give a step_NNNNNNNN directory of a run's "
                              "checkpoints (e.g. outputs/DATE/TIME/checkpoints/step_00000100).")
    cfg = OmegaConf.create(read_meta(checkpoint)["config"])
    model = instantiate(model_kwargs(cfg.model), "model")
    state = {"model": model.state_dict()}
    check_matches(checkpoint, state)
    with warnings.catch_warnings():
        # One process reading a checkpoint is what no_dist means; DCP still warns that no group exists.
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        dcp.load(state, storage_reader=reader(checkpoint), no_dist=True)  # only the model's keys are read
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state["model"], out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hydraddp.export", description=__doc__.strip().splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        print(f"wrote {export(args.checkpoint, args.out)}")
    except CheckpointError as exc:
        print(f"hydraddp.export: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
