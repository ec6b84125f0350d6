"""python -m hydraddp.export CHECKPOINT OUT [--format pt|hf]: a checkpoint's model, whatever wrap mode and world size
wrote it, in a format the ecosystem loads.

- ``--format pt`` (the default): one plain state_dict file, which loads with ``torch.load(OUT, weights_only=True)``
  into the unwrapped model the checkpoint was saved from (its config's sizes and the transformers config it recorded).
- ``--format hf``: a Hugging Face model directory (``config.json``, ``generation_config.json`` and safetensors, sharded
  above ``--max-shard-mb`` with a ``model.safetensors.index.json``) that ``AutoModelForCausalLM.from_pretrained(OUT)``
  loads; a transformers model's checkpoints only. The tensors are read from the DCP checkpoint one output file at a
  time: this process holds at most one file's tensors (``--max-shard-mb``), never the whole model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydraddp.handoff.checkpoints import CheckpointError
from hydraddp.train.formats import FORMATS, MAX_SHARD_MB, export

__all__ = ["export", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hydraddp.export", description=__doc__.strip().splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path, help="a file (pt) or a directory (hf)")
    parser.add_argument("--format", choices=FORMATS, default="pt",
                        help="pt: one state_dict file; hf: a Hugging Face model directory (transformers models)")
    parser.add_argument("--max-shard-mb", type=float, default=MAX_SHARD_MB,
                        help="hf: the largest safetensors file, in MB (10^6 bytes)")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {export(args.checkpoint, args.out, args.format, args.max_shard_mb)}")
    except CheckpointError as exc:
        print(f"hydraddp.export: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
