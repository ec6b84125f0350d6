"""scikit-learn's bundled 8x8 digits, read straight from its package data.

Reading the CSV avoids importing scikit-learn itself (about a second per worker); the file ships inside
scikit-learn's wheel, so nothing is downloaded.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset


def digits_file() -> Path:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("data=digits reads scikit-learn's bundled digits: install scikit-learn")
    return Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


def digits(eval_fraction: float = 0.15, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """1797 images of 64 pixels (scaled to [0, 1]) with labels 0-9, split into train and eval."""
    with gzip.open(digits_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images, labels = torch.from_numpy(table[:, :-1] / 16.0), torch.from_numpy(table[:, -1]).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_eval = int(len(labels) * eval_fraction)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[eval_idx], labels[eval_idx])


def digit_images(size: int = 32, eval_fraction: float = 0.15, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The digits as 3-channel ``size`` x ``size`` images (bilinear upsampling), for image models such as ResNets."""

    def as_images(split: TensorDataset) -> TensorDataset:
        pixels, labels = split.tensors
        images = torch.nn.functional.interpolate(pixels.reshape(-1, 1, 8, 8), size=(size, size), mode="bilinear")
        return TensorDataset(images.expand(-1, 3, -1, -1).contiguous(), labels)

    train, evaluation = digits(eval_fraction, seed)
    return as_images(train), as_images(evaluation)
