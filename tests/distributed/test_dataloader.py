"""auto_dataloader: global batch and workers split over ranks, data sharded, a new order each epoch."""

import pytest

import hydraddp.distributed as idist
from tests.distributed.workers import dataset
from tests.helpers.spawn import run_parallel


def test_one_process_keeps_the_batch_and_the_data():
    loader = idist.auto_dataloader(dataset(40), batch_size=8, shuffle=False)
    assert loader.batch_size == 8 and len(list(loader)) == 5 and not loader.pin_memory


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return run_parallel("tests.distributed.workers:dataloader_shards", tmp_path=tmp_path_factory.mktemp("dl"))


def test_two_ranks_split_the_batch_and_the_data(shards):
    for out in shards.values():
        assert (out["loader_type"], out["sampler"]) == ("DataLoader", "DistributedSampler")
        assert out["per_rank_batch"] == out["first_batch_rows"] == 4
        assert out["pin_memory"] is False
    for epoch in (0, 1):
        rank0, rank1 = shards[0]["epochs"][epoch], shards[1]["epochs"][epoch]
        assert len(rank0) == len(rank1) == 20
        assert sorted(rank0 + rank1) == list(range(40))  # disjoint and complete


def test_each_pass_is_a_new_epoch(shards):
    assert shards[0]["epochs"][0] != shards[0]["epochs"][1]
