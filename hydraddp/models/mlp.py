"""A small MLP classifier (the default experiment's model)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class MLP(nn.Sequential):
    """Linear layers with ReLU (and optional BatchNorm) between them, ending in class logits."""

    fsdp_block_classes: tuple[str, ...] = ()  # no blocks: FSDP units follow the size policy

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (256, 256), num_classes: int = 10,
                 batch_norm: bool = False):
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers.append(nn.Linear(width, size))
            if batch_norm:
                layers.append(nn.BatchNorm1d(size))
            layers.append(nn.ReLU())
            width = size
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
