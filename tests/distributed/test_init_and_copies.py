"""The initial state agrees by construction, and precision survives copies and pickling (2 gloo ranks)."""

import pytest

from tests.distributed.test_parity import FP32_TOL, max_param_diff

WRAPS = ("none", "ddp", "fsdp", "fsdp2")
PRECISIONS = ("fp32", "bf16", "bf16-true")  # fp16 needs CUDA: tests/gpu


@pytest.mark.parametrize("wrap", ["fsdp", "fsdp2", "ddp"])
def test_seed_plus_rank_init_trains_like_one_process(pools, wrap):
    # Each rank builds its own random weights; auto_model must start every rank from rank 0's.
    dist = pools.run("tests.distributed.workers:seed_plus_rank", wrap)
    one = pools.run("tests.distributed.workers:seed_plus_rank", None, backend="none", nproc=1)[0]
    assert max_param_diff(dist[0]["built"], dist[1]["built"]) > 0.1  # they really were built apart
    assert dist[0]["losses"] == pytest.approx(one["losses"], abs=FP32_TOL)
    assert max_param_diff(dist[0]["params"], one["params"]) < FP32_TOL


@pytest.fixture(scope="module")
def copies(pools):
    cases = [(w, p) for w in WRAPS for p in PRECISIONS]
    return pools.run("tests.distributed.workers:copies_and_pickles", cases, timeout=240)[0]


@pytest.mark.parametrize("op", ["deepcopy", "AveragedModel", "torch.save"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("wrap", WRAPS)
def test_copies_and_pickles_compute_like_the_original(copies, wrap, precision, op):
    for target in ("wrapped", "inner"):
        outcome = copies[(wrap, precision, target, op)]
        if outcome["torch_permits"]:  # hydraddp adds no failure of its own where torch allows the operation
            assert outcome["ours"] == "ok", (target, outcome)
        if precision != "fp32" and target == "wrapped":
            assert outcome["output_dtype"] == "torch.float32"  # the loss is computed in fp32


def test_plain_module_copies_are_permitted_and_used(copies):
    # The cases that matter most for EMA and SWA users: the unwrapped and the DDP-held module.
    for wrap in ("none", "ddp"):
        for precision in PRECISIONS:
            for op in ("deepcopy", "AveragedModel", "torch.save"):
                outcome = copies[(wrap, precision, "inner", op)]
                assert outcome["torch_permits"] and outcome["ours"] == "ok", (wrap, precision, op, outcome)
