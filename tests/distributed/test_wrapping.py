"""FSDP2 auto-wrap, FSDP1 policies and BatchNorm handling, applied for real on 2 gloo ranks."""

import pytest

from tests.parallel.test_policies import seed_style_policy

BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


@pytest.fixture(scope="module")
def reports(pools):
    mlp_min = 4 * 32 * 32 + 4 * 32 + 4 * 32 * 32 + 32  # one block MLP of tiny_transformer(dim=32)
    cases = {
        "fsdp2_blocks": ("fsdp2", {"block_classes": ["Block"]}),
        "fsdp2_blocks_by_type": ("fsdp2", {"auto_wrap_policy": "transformer",
                                           "block_classes": ["tests.distributed.models.Block"]}),
        "fsdp2_size": ("fsdp2", {"auto_wrap_policy": "size", "min_num_params": mlp_min}),
        "fsdp2_root": ("fsdp2", {"auto_wrap_policy": "root", "reshard_after_forward": False}),
        "fsdp1_seed_policy": ("fsdp", {"auto_wrap_policy": seed_style_policy}),
        "fsdp1_size": ("fsdp", {"auto_wrap_policy": "size", "min_num_params": mlp_min}),
        "fsdp1_transformer": ("fsdp", {"block_classes": ["Block"], "backward_prefetch": "backward_post",
                                       "sharding_strategy": "full_shard"}),
        "ddp": ("ddp", {}),
    }
    return pools.run("tests.distributed.workers:wrap_units", cases)


def test_fsdp2_block_autowrap_makes_exactly_the_blocks_and_the_root(reports):
    for name in ("fsdp2_blocks", "fsdp2_blocks_by_type"):
        report = reports[0][name]
        assert report["wrapper"] == "fsdp2"
        assert report["units"] == ["<root>", *BLOCKS]
        assert report["mesh_shape"] == [2]


def test_fsdp2_shards_about_half_the_parameter_bytes_per_rank(reports):
    for rank in (0, 1):
        report = reports[rank]["fsdp2_blocks"]
        unsharded = report["total_numel"] * 4
        assert report["param_bytes"] <= 0.55 * unsharded
        assert report["grad_bytes"] <= 0.55 * unsharded
        # AdamW keeps exp_avg and exp_avg_sq per parameter (plus a scalar step per tensor).
        assert 2 * report["param_bytes"] <= report["optim_state_bytes"] <= 0.55 * 2 * unsharded + 1024
    assert reports[0]["fsdp2_blocks"]["local_numel"] + reports[1]["fsdp2_blocks"]["local_numel"] == \
        reports[0]["fsdp2_blocks"]["total_numel"]
    ddp = reports[0]["ddp"]
    assert ddp["param_bytes"] == ddp["total_numel"] * 4


def test_fsdp2_size_policy_and_root_only(reports):
    assert reports[0]["fsdp2_size"]["units"] == ["<root>", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    assert reports[0]["fsdp2_root"]["units"] == ["<root>"]


def test_fsdp1_seed_style_policy_size_and_transformer_policies(reports):
    # The seed-style policy wraps whatever has at least 5000 parameters left over: each block's MLP (8.3k),
    # then the embedding + head left over at the root.
    assert reports[0]["fsdp1_seed_policy"]["units"] == ["<root>", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    assert reports[0]["fsdp1_size"]["units"] == ["<root>", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    assert reports[0]["fsdp1_transformer"]["units"] == ["<root>", *BLOCKS]
    assert reports[0]["fsdp1_transformer"]["wrapper"] == "fsdp"
    assert reports[0]["fsdp1_transformer"]["param_bytes"] <= 0.55 * reports[0]["fsdp1_transformer"]["total_numel"] * 4


@pytest.fixture(scope="module")
def batchnorm(pools):
    return pools.run("tests.distributed.workers:batchnorm_cases")


@pytest.mark.parametrize("wrap", ["fsdp", "fsdp2"])
def test_bf16_fsdp_keeps_batchnorm_in_its_own_fp32_unit(batchnorm, wrap):
    out = batchnorm[0][wrap]
    assert out["report"]["units"] == ["<root>", "1"]  # Sequential index 1 is the BatchNorm1d
    assert out["bn_running_mean_dtype"] == "torch.float32"
    # It trains like DDP under autocast, which also runs BatchNorm in fp32.
    assert out["losses"] == pytest.approx(batchnorm[0]["ddp"]["losses"], abs=1e-2)


def test_fsdp2_keeps_the_last_block_and_the_root_gathered_from_forward_to_backward(reports):
    """torchtitan's rule: backward starts with the last block, so resharding it after forward would only gather it
    again at once (the root is fully_shard's own exception). A reshard_after_forward the user gives wins."""
    assert reports[0]["fsdp2_blocks"]["kept_after_forward"] == ["<root>", "blocks.2"]
    assert reports[0]["fsdp2_root"]["kept_after_forward"] == ["<root>"]
    assert reports[0]["fsdp1_transformer"]["kept_after_forward"] == []
    assert all(not reports[0][name]["notes"] for name in ("fsdp2_blocks", "fsdp1_transformer", "ddp"))


def test_fsdp_over_one_rank_says_it_shards_nothing(pools):
    [alone] = pools.run("tests.distributed.workers:wrap_units", {"fsdp2": ("fsdp2", {"block_classes": ["Block"]}),
                                                                 "fsdp": ("fsdp", {"block_classes": ["Block"]})},
                        nproc=1).values()
    for wrap in ("fsdp2", "fsdp"):
        assert alone[wrap]["local_numel"] == alone[wrap]["total_numel"]
        assert alone[wrap]["notes"] == [f"wrap={wrap} over one data-parallel rank shards nothing: every rank holds "
                                        "every parameter, and pays FSDP's gathers and copies for it; wrap=ddp (or "
                                        "none) runs the same step without them"]
