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
        self.batch_norm = batch_norm

    def tp_plan(self) -> dict[str, str] | None:
        """Megatron's MLP split, pair by pair: the first Linear of a pair by its outputs (``colwise``), the second by
        its inputs (``rowwise``, summed over the TP group), so that the activation between them stays split. An odd
        last Linear (the classifier) stays whole on every TP rank. With BatchNorm, none: a BatchNorm between the two
        would see only its rank's features."""
        if self.batch_norm:
            return None
        linears = [name for name, module in self.named_children() if isinstance(module, nn.Linear)]
        pairs = zip(linears[0:len(linears) - 1:2], linears[1::2])
        return {name: style for pair in pairs for name, style in zip(pair, ("colwise", "rowwise"))}
