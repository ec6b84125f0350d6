"""Wrap policies resolved and planned without a process group (the spawned tests apply them for real)."""

import functools

import pytest
from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from hydraddp.parallel.policies import DEFAULT_MIN_NUM_PARAMS, bridge_policy, plan_units, resolve_policy
from tests.distributed.models import tiny_transformer


def seed_style_policy(module, recurse, unwrapped_params, min_num_params=5000):
    """The policy signature ignite/older torch docs show, which torch 2.13 can no longer call."""
    return True if recurse else unwrapped_params >= min_num_params


def test_seed_style_policy_is_bridged_to_torchs_keyword_call():
    bridged = bridge_policy(seed_style_policy)
    with pytest.raises(TypeError):
        seed_style_policy(module=None, recurse=False, nonwrapped_numel=10)  # what torch does
    assert bridged(module=None, recurse=False, nonwrapped_numel=10_000) is True
    assert bridged(module=None, recurse=False, nonwrapped_numel=10) is False


def test_torch_style_policies_keep_their_answers():
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    linear = nn.Linear(10, 10)
    assert bridge_policy(policy)(module=linear, recurse=False, nonwrapped_numel=110) is True
    assert bridge_policy(policy)(module=linear, recurse=False, nonwrapped_numel=99) is False


def test_no_policy_can_make_a_container_a_unit():
    # A ModuleList has no forward: as an FSDP unit its parameters would never be gathered.
    wrap_everything = bridge_policy(lambda module, recurse, nonwrapped_numel: True)
    assert wrap_everything(module=nn.ModuleList(), recurse=False, nonwrapped_numel=10**9) is False
    assert wrap_everything(module=nn.ModuleList(), recurse=True, nonwrapped_numel=10**9) is True
    model = tiny_transformer(depth=2)
    assert "blocks" not in plan_units(model, resolve_policy("size", min_num_params=1))


def test_block_policy_plans_one_unit_per_block():
    model = tiny_transformer(depth=3)
    assert plan_units(model, resolve_policy(block_classes=["Block"])) == ["blocks.0", "blocks.1", "blocks.2"]


def test_size_policy_groups_by_leftover_count():
    model = tiny_transformer(dim=32, depth=2)
    mlp_numel = sum(p.numel() for p in model.blocks[0].mlp.parameters())
    units = plan_units(model, resolve_policy("size", min_num_params=mlp_numel))
    # Each MLP reaches the threshold alone; what a block has left after its MLP does not.
    assert units == ["blocks.0.mlp", "blocks.1.mlp"]


def test_default_policy_is_size_based_with_the_documented_threshold():
    model = tiny_transformer()
    assert plan_units(model, resolve_policy()) == []  # tiny model: only the root becomes a unit
    assert resolve_policy().keywords == {"min_num_params": DEFAULT_MIN_NUM_PARAMS}


def test_already_sharded_modules_are_skipped():
    model = tiny_transformer(depth=2)
    units = plan_units(model, resolve_policy(block_classes=["Block"]), skip=lambda m: m is model.blocks[0])
    assert units == ["blocks.1"]


def test_unknown_policy_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'size', 'transformer', 'root'"):
        resolve_policy("bogus")
    with pytest.raises(ValueError, match="needs block_classes"):
        resolve_policy("transformer")
