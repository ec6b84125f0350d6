"""build_model(cfg) from a user's own script: compose, build, get the model and its WrapReport."""

import torch

from hydraddp import build_model
from hydraddp.config.compose import compose


def test_build_model_in_one_process():
    cfg = compose(["backend=none", "wrap=none", "launcher.nproc_per_node=1", "precision=bf16"])
    model, report = build_model(cfg)
    assert type(model).__name__ == "MLP"
    assert (report.wrapper, report.world_size, report.precision, report.param_dtype) == ("none", 1, "bf16", "bfloat16")
    assert report.total_numel == sum(p.numel() for p in model.parameters()) == report.local_numel
    logits = model(torch.rand(4, 64))
    assert logits.shape == (4, 10) and logits.dtype == torch.float32  # autocast inside, fp32 out


def test_the_same_seed_builds_the_same_weights():
    cfg = compose(["backend=none", "wrap=none", "launcher.nproc_per_node=1", "model=gpt", "data=text",
                   "model.depth=1"])
    first, _ = build_model(cfg)
    second, _ = build_model(cfg)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_fsdp_units_come_from_the_models_own_no_split_modules(pools):
    """A Hugging Face-style model (``_no_split_modules``) gets one FSDP unit per declared block, with no config."""
    out = pools.run("tests.train.workers:units_from_the_model", ["fsdp", "fsdp2"])
    for rank in (0, 1):
        for wrap in ("fsdp", "fsdp2"):
            assert sorted(out[rank][wrap]) == ["<root>", "layers.0", "layers.1", "layers.2"], (wrap, out[rank][wrap])


def test_the_gpt_under_fsdp2_returns_logits_that_are_not_a_view(pools):
    """FSDP2 warns when a module returns a view ("An in-place op on this view ... will silently drop the pre-backward
    hook"). The GPT's head has no bias, so its 3-D logits are a tensor of their own: one step, no such warning."""
    out = pools.run("tests.train.workers:fsdp2_gpt_warnings")
    for rank in (0, 1):
        assert not [w for w in out[rank] if "returned a view tensor" in w], out[rank]
