"""auto_dataloader, with ignite's rules: global batch and workers split over ranks, data sharded once, a new
order each epoch the sampler is set to, a given sampler kept or proxied."""

import pytest

import hydraddp.distributed as idist
from tests.distributed.workers import dataset


def test_one_process_keeps_the_batch_and_the_data():
    loader = idist.auto_dataloader(dataset(40), batch_size=8, shuffle=False)
    assert loader.batch_size == 8 and len(list(loader)) == 5 and not loader.pin_memory


@pytest.fixture(scope="module")
def shards(pools):
    return pools.run("tests.distributed.workers:dataloader_shards")


def test_two_ranks_split_the_batch_and_the_data(shards):
    for out in shards.values():
        assert (out["loader_type"], out["sampler"]) == ("DataLoader", "DistributedSampler")
        assert out["per_rank_batch"] == out["first_batch_rows"] == 4
        assert out["pin_memory"] is False
    for epoch in (0, 1):
        rank0, rank1 = shards[0]["epochs"][epoch], shards[1]["epochs"][epoch]
        assert len(rank0) == len(rank1) == 20
        assert sorted(rank0 + rank1) == list(range(40))  # disjoint and complete


def test_each_epoch_set_on_the_sampler_is_a_new_order(shards):
    assert shards[0]["epochs"][0] != shards[0]["epochs"][1]


@pytest.fixture(scope="module")
def given(pools):
    return pools.run("tests.distributed.workers:given_samplers")


def test_a_given_distributed_sampler_is_kept_and_covers_every_index_once(given):
    # It used to be sharded again: rank 0 of 2 got [0, 4] instead of [0, 2, 4, 6, 8], half the data unseen.
    assert given[0]["own_sampler_kept"] == given[1]["own_sampler_kept"] == "DistributedSampler"
    assert sorted(given[0]["own_indices"] + given[1]["own_indices"]) == list(range(10))


def test_a_sampler_of_another_rank_or_world_warns_as_ignite_does(given):
    for rank in (0, 1):
        assert given[rank]["warnings"] == [
            f"Found distributed sampler with rank={1 - rank}, but process rank is {rank}",
            "Found distributed sampler with num_replicas=3, but world size is 2",
        ]


def test_another_sampler_is_proxied_and_batches_follow_ignites_rules(given):
    assert given[0]["weighted_sampler"] == "DistributedProxySampler"
    assert len(given[0]["weighted_indices"]) == len(given[1]["weighted_indices"]) == 5
    assert (given[0]["uneven_batch"], given[0]["tiny_batch"]) == (2, 1)  # 5 // 2 floored; 1 < 2 ranks kept
