"""Small models for the core tests, importable by spawned workers."""

import torch
from torch import nn


class Block(nn.Module):
    """A transformer-like block: a mixing Linear pair and an MLP, each with a LayerNorm."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.Linear(dim, dim))
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3, vocab: int = 50):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_transformer(seed: int = 0, **kwargs) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
