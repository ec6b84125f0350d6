"""Datasets as users write them, for tests/train/test_checkpoint.py: a random augmentation drawn in the loader's
workers, and a stream (an ``IterableDataset`` with no length); and a reader of slow storage, for the Slurm checks
whose jobs must train for minutes without taking the machine's cores (scripts/slurm_checks/timelimit.py)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset, IterableDataset

from hydraddp.data.digits import digits


class Noisy(Dataset):
    """Each image with fresh Gaussian noise at every read: drawn from the RNG of whichever process reads it."""

    def __init__(self, base: Dataset, noise: float):
        self.base, self.noise = base, noise

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, label = self.base[index]
        return image + self.noise * torch.randn_like(image), label


class Slow(Dataset):
    """Each sample of ``base`` after ``delay_s``, as from a slow store: the step waits, and leaves the CPU to others."""

    def __init__(self, base: Dataset, delay_s: float):
        self.base, self.delay_s = base, delay_s

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        time.sleep(self.delay_s)
        return self.base[index]


class Stream(IterableDataset):
    """The samples of ``base`` one after another, as a reader of records would yield them."""

    def __init__(self, base: Dataset):
        self.base = base

    def __iter__(self):
        for index in range(len(self.base)):
            yield self.base[index]


def noisy_digits(noise: float = 0.5) -> tuple[Dataset, Dataset]:
    train, evaluation = digits()
    return Noisy(train, noise), evaluation


def slow_digits(delay_s: float = 0.005, eval_fraction: float = 0.15, seed: int = 0) -> tuple[Dataset, Dataset]:
    train, evaluation = digits(eval_fraction=eval_fraction, seed=seed)
    return Slow(train, delay_s), evaluation


def digit_stream() -> tuple[IterableDataset, Dataset]:
    train, evaluation = digits()
    return Stream(train), evaluation


def token_stream(**kwargs) -> tuple[IterableDataset, Dataset]:
    """``hydraddp.data.text.token_dicts`` (same arguments) with its training set as a stream."""
    from hydraddp.data.text import token_dicts

    train, evaluation = token_dicts(**kwargs)
    return Stream(train), evaluation
