"""A small decoder-only transformer for character-level text; sizes come from config."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hydraddp.parallel.pipeline import PipelineShape


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.dim={dim} must be a multiple of model.heads={heads}")
        self.heads, self.head_dim = heads, dim // heads
        # One matmul for q, k and v, laid out head by head (each head's q, k, v rows together), so that tensor
        # parallel's column split of it gives each rank whole heads. The head count is -1 in forward: a TP rank
        # holds heads / tp of them.
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))
        self.dropout = nn.Dropout(dropout)  # on each residual branch, as in GPT-2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Token + position embeddings, ``depth`` blocks, a final norm and an untied, bias-free head; returns logits.

    Ready for pipeline parallel (``parallel.pipeline``), as torchtitan's models are: the blocks are a ``ModuleDict``
    keyed by their index (the same names as a list's, so a stage that keeps some of them keeps their names, and a
    checkpoint loads at any pipeline degree), and a stage without the embeddings (``tok_emb`` None) takes the hidden
    states, one without the head (``head`` None) returns them."""

    fsdp_block_classes = ("GPTBlock",)
    pipeline_shape = PipelineShape(blocks="blocks", first=("tok_emb", "pos_emb"), last=("norm", "head"))

    def __init__(self, vocab_size: int = 128, seq_len: int = 64, dim: int = 128, depth: int = 4, heads: int = 4,
                 mlp_ratio: int = 4, dropout: float = 0.0):
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleDict({str(index): GPTBlock(dim, heads, mlp_ratio, dropout) for index in range(depth)})
        self.norm = nn.LayerNorm(dim)
        # No bias, as GPT-2's and Llama's heads: and so the logits are not a view. On a 3-D input, a Linear with a bias
        # returns a view of its 2-D addmm, and an FSDP2 root that returns a view warns that an in-place op on it
        # would skip the all-gather (without the bias, matmul's result is a tensor of its own).
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        if self.tok_emb is not None:
            x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x

    def tp_plan(self) -> dict[str, object]:
        """Tensor parallel with sequence parallel (Megatron's, as torchtitan's Llama): attention and MLP split by
        heads and hidden units (column, then row), and between them the residual stream, norms and dropouts split
        along the sequence, so that no TP rank holds a whole activation outside a matmul."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel)

        gather_sequence = lambda: PrepareModuleInput(input_layouts=(Shard(1),),  # noqa: E731
                                                     desired_input_layouts=(Replicate(),))
        return {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (seq, dim)
            "blocks.*.norm1": SequenceParallel(), "blocks.*.norm2": SequenceParallel(),
            "blocks.*.attn": gather_sequence(),
            "blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "blocks.*.mlp": gather_sequence(),
            "blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),  # every rank: all logits
        }

    def flops_per_token(self) -> float:
        """Training FLOPs per token (6 per parameter plus attention), for MFU."""
        params = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        dim, depth = self.tok_emb.embedding_dim, len(self.blocks)
        return 6 * params + 12 * depth * dim * self.seq_len
