"""trainer.compile=true with every default on, evaluation and a checkpoint in between, read from Dynamo's own counters
(``torch._dynamo.utils.counters``): no graph break inside a compiled block, no recompile once training and
evaluation have each run, and every step after the measured one (plan.measure) runs the compiled graphs.

The last once failed silently: the measured step ran under MemTracker's dispatch mode, Dynamo gave up on the frame,
and a frame it gives up on stays skipped, so every later step and evaluation of a compiled run ran eagerly."""

import pytest

GPT = ["model=gpt", "data=text", "task=causal_lm", "model.depth=2", "model.dim=32", "model.heads=2", "data.seq_len=16",
       "data.batch_size=8", "data.eval_batch_size=16", "data.dataset.num_chars=4000", "trainer.max_steps=9",
       "trainer.log_every=1", "trainer.eval_every=3", "trainer.compile=true", "checkpoint.every_n_steps=4"]


@pytest.fixture(scope="module")
def counted(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    cases = {wrap: [*GPT, f"wrap={wrap}", f"checkpoint.dir={root / wrap}"] for wrap in ("ddp", "fsdp2")}
    return pools.run("tests.train.workers:compile_counts", cases, timeout=600)[0]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_compiled_training_has_no_graph_break_and_no_recompile_after_the_first_steps(counted, wrap):
    seen, breaks = counted[wrap]["seen"], counted[wrap]["breaks"]
    assert breaks == {}, breaks
    assert [phase for phase, *_ in seen].count("train") == 9
    first_eval = next(i for i, (phase, *_) in enumerate(seen) if phase == "eval")
    frames_after_warmup = seen[first_eval + 1][1]  # training compiled at step 1, evaluation at its first batch
    assert all(frames == frames_after_warmup for _, frames, _, _ in seen[first_eval + 1:]), seen


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_every_step_after_the_measured_one_runs_the_compiled_graphs(counted, wrap):
    seen = counted[wrap]["seen"]
    eager_from_step_3 = seen[2][3]  # step 2 is the measured step (plan.measure), run eagerly under the tracker
    assert eager_from_step_3 > 0  # the probe counts: the measured step's blocks ran as Python
    assert all(eager == eager_from_step_3 for *_, eager in seen[2:]), seen
