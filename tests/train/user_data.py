"""Datasets as users write them, for tests/train/test_checkpoint.py: a random augmentation drawn in the loader's
workers, and a stream (an ``IterableDataset`` with no length)."""

from __future__ import annotations

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


def digit_stream() -> tuple[IterableDataset, Dataset]:
    train, evaluation = digits()
    return Stream(train), evaluation


def token_stream(**kwargs) -> tuple[IterableDataset, Dataset]:
    """``hydraddp.data.text.token_dicts`` (same arguments) with its training set as a stream."""
    from hydraddp.data.text import token_dicts

    train, evaluation = token_dicts(**kwargs)
    return Stream(train), evaluation
