"""Models built on the meta device and initialized module by module (hydraddp.distributed.meta_init) hold, to the
bit, what the model built whole under the same seed holds: in one process, and sharded on 2 ranks under fsdp and fsdp2
(and whole under ddp), whatever order the modules are materialized in. What cannot be replayed says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hydraddp.distributed as idist
from hydraddp.distributed.meta_init import NotReplayable, build_on_meta
from hydraddp.models.gpt import GPT
from hydraddp.models.mlp import MLP

SEED = 3


def small_gpt() -> nn.Module:
    return GPT(vocab_size=64, seq_len=16, dim=32, depth=2, heads=2)


def small_llama() -> nn.Module:
    from hydraddp.models.hf import causal_lm

    # Its inner model's post_init initializes it before the head is built: the order the replay must keep.
    return causal_lm("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2)


FACTORIES = {"gpt": small_gpt, "mlp": MLP, "llama": small_llama}


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (non-persistent ones too: a rotary embedding's inverse frequencies)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def whole_and_meta(name: str) -> tuple[nn.Module, torch.Tensor, nn.Module, object, torch.Tensor]:
    torch.manual_seed(SEED)
    whole = FACTORIES[name]()
    after_whole = torch.rand(4)
    torch.manual_seed(SEED)
    meta, replay = build_on_meta(FACTORIES[name])
    after_meta = torch.rand(4)
    return whole, after_whole, meta, replay, after_meta


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_model_built_on_meta_gets_the_whole_builds_values_in_any_order(name):
    whole, after_whole, meta, replay, after_meta = whole_and_meta(name)
    assert all(t.is_meta for t in tensors(meta).values())
    assert torch.equal(after_whole, after_meta)  # the generator is left where the whole build leaves it
    for module in reversed(list(meta.modules())):  # the last module first: each from its own recorded state
        replay.materialize_module(module)
    expected, got = tensors(whole), tensors(meta)
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


class DrawsInInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))  # drawn here, by no reset_parameters: nothing can draw it again


class ReinitializedAfterConstruction(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        for layer in (self.first, self.second):  # GPT-2-style init after construction, outside reset_parameters
            nn.init.normal_(layer.weight, std=0.02)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("factory, reason", [
    (DrawsInInit, "scale (DrawsInInit) is not set by any reset_parameters() or Hugging Face _init_weights"),
    (ReinitializedAfterConstruction, "Linear's tensors are written at two separate times during construction"),
    (Tied, "embed.weight and head.weight are one tensor (tied weights)"),
])
def test_a_model_whose_initialization_cannot_be_replayed_says_which_module_and_why(factory, reason):
    with pytest.raises(NotReplayable) as raised:
        build_on_meta(factory)
    assert reason in str(raised.value)


def sharded_from_meta(local_rank: int, name: str, wraps: list[str]) -> dict:
    """Per wrap: the wrapper, and the parameters whose full value (gathered from the shards) is not the whole
    build's to the bit."""
    from tests.distributed.workers import full_params

    out = {}
    for wrap in wraps:
        torch.manual_seed(SEED)
        expected = {k: v.detach().clone() for k, v in FACTORIES[name]().state_dict().items()}
        torch.manual_seed(SEED)
        model, _ = build_on_meta(FACTORIES[name])
        wrapped = idist.auto_model(model, wrap=wrap)
        got = full_params(wrapped)
        report = idist.wrap_report(wrapped)
        out[wrap] = {"wrapper": report.wrapper, "init_device": report.init_device, "keys_match": set(expected) == set(got),
                     "differ": sorted(k for k in expected if k in got and not torch.equal(expected[k], got[k].cpu()))}
    return out


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_built_on_meta_and_sharded_on_two_ranks_the_full_parameters_are_the_whole_builds(pools, name):
    out = pools.run("tests.distributed.test_meta_init:sharded_from_meta", name, ["fsdp2", "fsdp", "ddp"])
    for rank in (0, 1):
        for wrap, seen in out[rank].items():
            assert seen == {"wrapper": wrap, "init_device": "meta", "keys_match": True, "differ": []}, (rank, wrap)


def test_init_device_meta_that_cannot_be_replayed_is_refused_before_launch():
    """model.init_device=meta is a promise: the launch tries the build on the meta device and refuses it (exit 2)."""
    from omegaconf import OmegaConf

    from hydraddp.config.compose import compose
    from hydraddp.launch_plan import model_problems

    cfg = compose(["wrap=fsdp2", "model.init_device=meta"])
    assert model_problems(cfg, []) == []  # the MLP replays
    cfg.model = OmegaConf.create({"_target_": f"{__name__}.DrawsInInit", "init_device": "meta", "sync_bn": False,
                                  "pretrained": None})
    [problem] = model_problems(cfg, [])
    assert problem.keys == ("model.init_device",)
    assert "model.init_device=meta: scale (DrawsInInit) is not set by any reset_parameters()" in problem.message
    assert "model.init_device=cpu" in problem.fix
    cfg.wrap.name = "ddp"  # meta under ddp too: built on the meta device, then filled whole
    assert [p.keys for p in model_problems(cfg, [])] == [("model.init_device",)]


STEPS, GLOBAL_BATCH, SEQ = 10, 8, 16


def token_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def loss_of(name: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if name == "llama":  # a transformers model computes its own
        return model(input_ids=tokens, labels=tokens).loss
    out = model(tokens)
    return nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.size(-1)), tokens[:, 1:].reshape(-1))


def trained(name: str, model: nn.Module, rank: int = 0, world: int = 1, tp: int = 1) -> tuple[list[float], nn.Module]:
    """STEPS SGD steps over the global batches, this rank's share of each; the global loss of each step. (SGD: Adam's
    normalized update turns the last bits of a near-zero gradient, which the reduction order sets, into lr-sized
    differences of the parameters.) Under tensor parallel, ``rank`` and ``world`` are the data-parallel ones: the
    ``tp`` ranks of a TP group read the same share."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in token_batches():
        loss = loss_of(name, model, batch.chunk(world)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(idist.all_reduce(loss.detach()) / (world * tp)) if world * tp > 1 else loss.item())
    return losses, model


def trained_from_meta(local_rank: int, name: str, wraps: list[str]) -> dict:
    from tests.distributed.workers import full_params

    out = {}
    for wrap in wraps:
        torch.manual_seed(SEED)
        model, _ = build_on_meta(FACTORIES[name])
        losses, wrapped = trained(name, idist.auto_model(model, wrap=wrap), idist.get_rank(), idist.get_world_size())
        out[wrap] = {"losses": losses, "params": {k: v.cpu() for k, v in full_params(wrapped).items()}}
    return out


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_built_on_meta_and_trained_on_two_ranks_as_one_process_built_whole(pools, name):
    """Issue 26's exact init, carried through training: 10 steps later every wrap is where one process is (1e-5)."""
    torch.manual_seed(SEED)
    expected_losses, whole = trained(name, FACTORIES[name]())
    expected = whole.state_dict()
    out = pools.run("tests.distributed.test_meta_init:trained_from_meta", name, ["ddp", "fsdp", "fsdp2"])
    for wrap, seen in out[0].items():
        assert seen["losses"] == pytest.approx(expected_losses, abs=1e-5), wrap
        worst = max((seen["params"][k] - expected[k].float()).abs().max().item() for k in expected)
        assert worst <= 1e-5, (wrap, worst)
    assert out[0]["fsdp2"]["losses"] == out[1]["fsdp2"]["losses"]
