"""No-decay parameter groups (optim.no_decay_norm_and_bias) under every wrap."""

from __future__ import annotations

import pytest

from hydraddp.build import wrap_kwargs
from hydraddp.config.compose import compose
from hydraddp.preflight.config import problems


def test_no_decay_groups_hold_exactly_the_biases_and_norm_weights_under_every_wrap(pools):
    out = pools.run("tests.train.workers:no_decay_groups", ["none", "ddp", "fsdp", "fsdp2"])
    for rank in (0, 1):
        for wrap, groups in out[rank].items():
            assert groups["exempt"] == groups["expected"], wrap
            assert any(name.endswith("norm1.weight") for name in groups["exempt"]) and "blocks.0.mlp.0.bias" in groups["exempt"]
            assert groups["decayed"] + len(groups["exempt"]) == groups["total"], wrap
            assert groups["decays"] == [0.1, 0.0], wrap


def test_fsdp1_gets_its_original_parameters_and_a_flat_one_is_refused():
    cfg = compose(["wrap=fsdp", "optim.no_decay_norm_and_bias=true"])
    assert wrap_kwargs(cfg, object())["use_orig_params"] is True
    flat = compose(["wrap=fsdp", "optim.no_decay_norm_and_bias=true", "+wrap.kwargs.use_orig_params=false"])
    [problem] = [p for p in problems(flat) if "optim.no_decay_norm_and_bias" in p.keys]
    assert "wrap.kwargs.use_orig_params=false flattens them" in problem.message
    assert "Drop wrap.kwargs.use_orig_params" in problem.fix


def test_accumulating_four_micro_batches_is_one_step_with_one_gradient_reduction(pools):
    """trainer.accumulate_grad_batches=4 gives the parameters of K=1 at the same batch (fp32, 1e-5), and the ranks
    exchange gradients once per optimizer step, as with K=1 (counted by torch's CommDebugMode, not assumed)."""
    out = pools.run("tests.train.workers:accumulation", ["ddp", "fsdp", "fsdp2"])
    for rank in (0, 1):
        for wrap in ("ddp", "fsdp", "fsdp2"):
            one, four = out[rank][(wrap, 1)], out[rank][(wrap, 4)]
            assert one["reductions"] == four["reductions"] == [1, 1, 1], wrap
            for name, value in one["params"].items():
                assert (four["params"][name] - value).abs().max().item() < 1e-5, (wrap, name)


def test_a_k_that_does_not_divide_the_per_rank_batch_is_refused_with_the_fix():
    cfg = compose(["data.batch_size=64", "trainer.accumulate_grad_batches=5"])  # 32 per rank on 2 ranks
    [problem] = [p for p in problems(cfg) if "trainer.accumulate_grad_batches" in p.keys]
    assert problem.message.startswith("trainer.accumulate_grad_batches=5 does not divide the per-rank batch of 32")
    assert "a divisor of 32 (2, 4, 8, 16, 32, ...)" in problem.fix


def test_activation_checkpointing_keeps_the_losses_and_says_where_it_is(pools):
    out = pools.run("tests.train.workers:activation_checkpointing", ["ddp", "fsdp", "fsdp2"])
    for rank in (0, 1):
        for wrap in ("ddp", "fsdp", "fsdp2"):
            plain, checkpointed = out[rank][(wrap, False)], out[rank][(wrap, True)]
            assert plain["checkpointed"] == [] and checkpointed["checkpointed"] == ["blocks.0", "blocks.1"], wrap
            for a, b in zip(plain["losses"], checkpointed["losses"]):
                assert abs(a - b) < 1e-6, (wrap, plain["losses"], checkpointed["losses"])


def test_activation_checkpointing_lowers_the_measured_peak_of_activations():
    """torch's MemTracker on CPU, one forward and backward of the GPT (4 blocks, batch 32 x 64 tokens): the peak of
    activation memory falls by more than half (64.3 -> 15.1 MiB when this was written)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    import hydraddp.distributed as idist
    from hydraddp.models.gpt import GPT
    from hydraddp.train.tasks import CausalLM

    peaks = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = idist.auto_model(GPT(depth=4, dim=128, heads=4, seq_len=64), wrap="none",
                                 activation_checkpointing=checkpointing)
        batch = (torch.randint(0, 128, (32, 64)), torch.randint(0, 128, (32, 64)))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            CausalLM().loss(model, batch).backward()
        cpu = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        peaks[checkpointing] = next(v for k, v in cpu.items() if getattr(k, "value", k) == "Activation")
    assert peaks[True] < peaks[False] / 2, peaks


@pytest.mark.slow
def test_compiled_models_match_eager_losses_under_ddp_and_fsdp2(pools):
    """trainer.compile=true: the whole MLP under ddp, and under fsdp2 too (it declares no blocks); the GPT per block
    before fully_shard. Dynamo really captures graphs (torch 2.13's own ``nn.Module.compile()`` would not, on
    nn.Sequential), and the losses are the eager ones within 1e-4."""
    runs = [("mlp", "ddp"), ("mlp", "fsdp2"), ("gpt", "fsdp2")]
    out = pools.run("tests.train.workers:compiled", runs, timeout=600)
    expected = {"mlp": ["<root>"], "gpt": ["blocks.0", "blocks.1"]}
    for rank in (0, 1):
        for model, wrap in runs:
            eager, compiled = out[rank][(model, wrap, False)], out[rank][(model, wrap, True)]
            assert eager["compiled"] == [] and eager["graphs"] == 0, (model, wrap)
            assert compiled["compiled"] == expected[model] and compiled["graphs"] >= 1, (model, wrap, compiled)
            for a, b in zip(eager["losses"], compiled["losses"]):
                assert abs(a - b) < 1e-4, (model, wrap, eager["losses"], compiled["losses"])


def test_compile_is_refused_where_it_cannot_work_with_the_reason_and_the_fix():
    cfg = compose(["wrap=fsdp", "trainer.compile=true"])
    [problem] = [p for p in problems(cfg) if "trainer.compile" in p.keys]
    assert problem.message.startswith("trainer.compile=true cannot run with wrap=fsdp: FSDP1 runs its unit hooks")
    assert "Use wrap=fsdp2 (compiled per block) or wrap=ddp (the whole model)" in problem.fix
    assert not [p for p in problems(compose(["wrap=fsdp2", "trainer.compile=true"])) if "trainer.compile" in p.keys]
