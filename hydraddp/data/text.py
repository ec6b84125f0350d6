"""Character-level text generated from a small grammar: structure to learn, nothing to download."""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset

SUBJECTS = ["the fox", "a rank", "the model", "every worker", "the optimizer", "a shard", "the gradient", "our team"]
VERBS = ["gathers", "reduces", "scatters", "trains", "waits for", "broadcasts", "checkpoints", "wraps"]
OBJECTS = ["the parameters", "a bucket", "the loss", "its neighbour", "the batch", "every unit", "the mesh"]
ENDINGS = [".", " today.", " again.", " in bf16.", " at rank zero.", " before the barrier."]


def generate(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < num_chars:
        sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)} "
        parts.append(sentence.capitalize())
        length += len(sentence)
    return "".join(parts)[:num_chars]


class CharWindows(Dataset):
    """Windows of ``seq_len + 1`` ASCII codes: input is the first ``seq_len``, target the next character."""

    def __init__(self, codes: torch.Tensor, seq_len: int):
        self.codes, self.seq_len = codes, seq_len

    def __len__(self) -> int:
        return (len(self.codes) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.codes[index * self.seq_len : (index + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def _codes(num_chars: int, seed: int) -> torch.Tensor:
    return torch.tensor(list(generate(num_chars, seed).encode("ascii")), dtype=torch.long)


def text(seq_len: int = 64, num_chars: int = 200_000, seed: int = 0, eval_fraction: float = 0.1):
    codes = _codes(num_chars, seed)
    split = int(len(codes) * (1 - eval_fraction))
    return CharWindows(codes[:split], seq_len), CharWindows(codes[split:], seq_len)


class TokenDicts(Dataset):
    """Windows of ``seq_len`` codes as a Hugging Face causal-LM sample: ``input_ids`` and ``labels``, the same
    tokens (the model shifts its labels itself)."""

    def __init__(self, codes: torch.Tensor, seq_len: int):
        self.codes, self.seq_len = codes, seq_len

    def __len__(self) -> int:
        return len(self.codes) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.codes[index * self.seq_len : (index + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


def token_dicts(seq_len: int = 64, num_chars: int = 200_000, seed: int = 0, eval_fraction: float = 0.1):
    codes = _codes(num_chars, seed)
    split = int(len(codes) * (1 - eval_fraction))
    return TokenDicts(codes[:split], seq_len), TokenDicts(codes[split:], seq_len)
