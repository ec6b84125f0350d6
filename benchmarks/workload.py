"""The workloads every peer trains: hydraddp's own defaults, spelled out for the scripts that do it by hand.

MLP 64 -> 4 x 1024 -> 10 on scikit-learn's digits, 64 samples per rank, AdamW (lr 3e-3, weight decay 0.01)
with a cosine schedule, gradient clipping at 1.0, seed 0. The timing rules match hydraddp's loop:
the first optimizer step's wall-clock time, and steady-state samples/s after WARMUP_STEPS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

HIDDEN = (1024, 1024, 1024, 1024)
BATCH_PER_RANK = 64
LR, WEIGHT_DECAY, GRAD_CLIP, SEED = 0.003, 0.01, 1.0, 0
WARMUP_STEPS = 10  # as hydraddp.train.metrics.WARMUP_STEPS

# The Hugging Face workload: a Llama from its config (model=hf_causal_lm), on the generated text as token dicts
# (data=tokens), 16 sequences of 64 tokens per rank; FSDP units are its decoder layers.
HF_SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2}
HF_BATCH_PER_RANK = 16

# The GPU benchmark's GPT (about 150M parameters) on generated text, bf16.
GPT_SHAPE = {"dim": 1024, "depth": 12, "heads": 16, "seq_len": 512, "batch_per_gpu": 16, "num_chars": 4_000_000}


def model(hidden=HIDDEN):
    """The same module hydraddp builds for model=mlp (identical initialization under the seed)."""
    import torch

    from hydraddp.models.mlp import MLP

    torch.manual_seed(SEED)
    return MLP(in_features=64, hidden=list(hidden), num_classes=10)


def hf_model():
    """The module hydraddp builds for model=hf_causal_lm with HF_SIZES (identical initialization under the seed)."""
    import torch

    from hydraddp.models.hf import causal_lm

    torch.manual_seed(SEED)
    return causal_lm("llama", vocab_size=128, max_position_embeddings=512, tie_word_embeddings=False, **HF_SIZES)


def hf_train_set():
    from hydraddp.data.text import token_dicts

    return token_dicts(seq_len=64, num_chars=200000, seed=0)[0]


def train_set():
    from hydraddp.data.digits import digits

    return digits(eval_fraction=0.15, seed=0)[0]


def arguments(spawns_ranks: bool = False) -> argparse.ArgumentParser:
    """The command line every peer script shares; ``spawns_ranks``: the script starts its own ranks (``--nproc``)."""
    parser = argparse.ArgumentParser()
    if spawns_ranks:
        parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    parser.add_argument("--out", required=True)
    return parser


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def write_result(path: str | os.PathLike, result: dict) -> None:
    Path(path).write_text(json.dumps(result))


class StepClock:
    """hydraddp's loop's timing rules, for the peers: when the first optimizer step ended (wall clock), and
    samples/s over the steps after WARMUP_STEPS."""

    def __init__(self, steps: int):
        self.warmup_end = min(WARMUP_STEPS, steps - 1)
        self.first_step_at = 0.0
        self._steady_start: float | None = None
        self._steady_samples = 0

    def step_done(self, step: int, samples: int) -> None:
        """Call right after optimizer and scheduler step ``step`` (from 1), with the samples of all ranks."""
        if self._steady_start is not None:
            self._steady_samples += samples
        if step == self.warmup_end:
            self._steady_start = time.perf_counter()
        if step == 1:
            self.first_step_at = time.time()

    def steady_samples_per_s(self) -> float:
        return self._steady_samples / (time.perf_counter() - self._steady_start)
