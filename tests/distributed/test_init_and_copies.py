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


@pytest.mark.every_python  # pickles of every wrap and precision: what a Python pickles differs between patch levels
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


def broadcasts_of_a_whole_build(local_rank: int) -> dict:
    """auto_model(fsdp2) of a model each rank built differently: how many broadcasts it sent, and whether every rank
    then holds rank 0's values."""
    import torch
    import torch.distributed as dist

    import hydraddp.distributed as idist
    from tests.distributed.workers import full_params, mlp

    calls = {"broadcast": 0, "coalesced": 0}
    real_broadcast, real_coalesced = dist.broadcast, dist._broadcast_coalesced

    def broadcast(*args, **kwargs):
        calls["broadcast"] += 1
        return real_broadcast(*args, **kwargs)

    def coalesced(*args, **kwargs):
        calls["coalesced"] += 1
        return real_coalesced(*args, **kwargs)

    torch.manual_seed(100 + idist.get_rank())
    model = mlp()
    dist.broadcast, dist._broadcast_coalesced = broadcast, coalesced
    try:
        wrapped = idist.auto_model(model, wrap="fsdp2")
    finally:
        dist.broadcast, dist._broadcast_coalesced = real_broadcast, real_coalesced
    torch.manual_seed(100)
    expected = mlp().state_dict()
    got = full_params(wrapped)
    return {**calls, "tensors": len(list(model.parameters())),
            "differ": sorted(k for k in expected if not torch.equal(expected[k], got[k]))}


def test_a_whole_build_is_broadcast_in_a_coalesced_few_not_one_per_tensor(pools):
    out = pools.run("tests.distributed.test_init_and_copies:broadcasts_of_a_whole_build")
    for rank in (0, 1):
        assert out[rank]["tensors"] > 2 and out[rank]["differ"] == [], out[rank]
        assert (out[rank]["broadcast"], out[rank]["coalesced"]) == (0, 1), out[rank]
