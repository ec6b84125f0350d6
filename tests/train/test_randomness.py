"""Per-rank randomness: each data-parallel rank draws its own dropout masks and its loader workers their own
augmentations (the same "random" noise on every replica's different data would be correlated across the global
batch), while the ranks of one tensor-parallel group draw the same masks (a replicated activation must stay equal on
them). A resume stays exact: tests/train/test_checkpoint.py stops and resumes dropout and augmented runs bit-for-bit."""

import torch
from torch.utils.data import Dataset

from hydraddp.train import data

GPT = ["model=gpt", "data=text", "task=causal_lm", "model.depth=2", "model.dim=16", "model.heads=2",
       "model.dropout=0.5", "data.seq_len=16", "data.batch_size=8", "data.dataset.num_chars=4000",
       "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0"]


def test_data_parallel_ranks_draw_their_own_dropout_masks_and_a_tp_group_draws_one(pools):
    ranks = pools.run("tests.train.workers:dropout_masks",
                      {"ddp": [*GPT, "wrap=ddp"], "tp": [*GPT, "wrap=fsdp2", "mesh.dp_shard=1", "mesh.tp=2"]},
                      timeout=300)
    for case in ("ddp", "tp"):
        assert len(ranks[0][case]["masks"]) == 3 * 2 * 2  # 3 steps, 2 blocks, 2 dropouts each
        assert len(ranks[1][case]["masks"]) == len(ranks[0][case]["masks"])
    # Two replicas: no step's mask is the other's.
    assert not any(torch.equal(a, b) for a, b in zip(ranks[0]["ddp"]["masks"], ranks[1]["ddp"]["masks"]))
    # One replica split over a TP group of 2: the residual stream is replicated, and both ranks drop the same units.
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["tp"]["masks"], ranks[1]["tp"]["masks"]))
    assert ranks[0]["tp"]["losses"] == ranks[1]["tp"]["losses"]


class Noise(Dataset):
    """Nothing but what an augmentation draws: a sample is the loader worker's random numbers."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(4)


def _first_batches(data_rank: int, seed: int = 0, count: int = 3) -> list[torch.Tensor]:
    loader = data.train_loader(data.WorkerRng(Noise()), batch_size=8, num_workers=1, seed=seed)
    batches = data.Batches(loader, 0, seed, data_rank=data_rank)
    return [next(batches) for _ in range(count)]


def test_loader_workers_are_seeded_per_data_parallel_rank_and_alike_for_one():
    rank0, rank1, rank0_again = _first_batches(0), _first_batches(1), _first_batches(0)
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank0_again))  # reproducible
    assert not any(torch.equal(a, b) for a, b in zip(rank0, rank1))  # but each rank its own stream
