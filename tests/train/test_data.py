"""The loop's data at several world sizes: evaluation counts each sample exactly once, and the
model's FLOPs for MFU are the whole model's, not one rank's shard."""

import pytest

from tests.helpers.spawn import NO_PLAN, UNTRACKED, run_cli

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md


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


# (ranks, samples, global eval batch): rank 0 has one batch more than the others; or the last rank has none at all.
UNEVEN = [(2, 13, 4), (3, 13, 6), (3, 2, 3)]


@pytest.mark.parametrize("world, samples, batch_size", UNEVEN, ids=[f"{w}ranks-{s}samples" for w, s, _ in UNEVEN])
def test_an_eval_set_that_does_not_split_evenly_gives_one_processs_metrics_under_every_wrap(pools, world, samples,
                                                                                              batch_size):
    wraps = ["ddp", "fsdp", "fsdp2"]
    [alone] = pools.run("tests.train.workers:evaluate_unevenly", ["none"], samples, batch_size, backend="none",
                        nproc=1).values()
    out = pools.run("tests.train.workers:evaluate_unevenly", wraps, samples, batch_size, nproc=world)
    assert len({out[rank]["ddp"]["batches"] for rank in range(world)}) == 2  # the shards are uneven indeed
    for rank in range(world):
        for wrap in wraps:
            got = out[rank][wrap]
            assert got["samples"] == samples, (rank, wrap)
            for name, value in alone["none"]["metrics"].items():
                assert got["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (rank, wrap, name)


def test_a_launch_whose_eval_set_does_not_split_evenly_finishes(tmp_path):
    # As measured: 313 eval windows over 2 ranks, rank 0 one batch more; its FSDP2 all-gather met a peer that had
    # gone on to the metrics, and the launch died ("Connection reset by peer"; a hang on nccl).
    done = run_cli("model=gpt", "data=text", "task=causal_lm", "wrap=fsdp2", "model.depth=2", "model.dim=32",
                   "data.dataset.num_chars=200350", "data.eval_batch_size=156", "trainer.max_steps=2",
                   "trainer.eval_every=0", NO_PLAN, UNTRACKED, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval perplexity" in done.stdout


def test_mfu_counts_the_whole_model_under_fsdp1(pools, one_process):
    out = pools.run("tests.train.workers:evaluate_all_digits", nproc=2)
    assert out[0]["bare_flops"] == out[1]["bare_flops"] == one_process["bare_flops"]
    assert out[0]["shard_flops"] < out[0]["bare_flops"]  # what the count after wrapping used to see
