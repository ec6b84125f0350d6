"""The loop's data at several world sizes: evaluation counts each sample exactly once, and the
model's FLOPs for MFU are the whole model's, not one rank's shard."""

import pytest

pytestmark = pytest.mark.slow  # launches for real: see README, Tests



@pytest.fixture(scope="module")
def one_process(pools):
    return pools.run("tests.train.workers:evaluate_all_digits", backend="none", nproc=1)[0]


@pytest.mark.parametrize("world", [2, 3])
def test_evaluation_counts_each_of_1797_digits_once(pools, one_process, world):
    # 1797 does not split over 2 or 3 ranks' batches evenly; a padded sampler counted some digits twice.
    out = pools.run("tests.train.workers:evaluate_all_digits", nproc=world)
    for rank in range(world):
        loss, accuracy, samples = out[rank]["evaluation"]
        assert samples == 1797
        assert loss == pytest.approx(one_process["evaluation"][0], abs=1e-6)
        assert accuracy == one_process["evaluation"][1]


def test_mfu_counts_the_whole_model_under_fsdp1(pools, one_process):
    out = pools.run("tests.train.workers:evaluate_all_digits", nproc=2)
    assert out[0]["bare_flops"] == out[1]["bare_flops"] == one_process["bare_flops"]
    assert out[0]["shard_flops"] < out[0]["bare_flops"]  # what the count after wrapping used to see
