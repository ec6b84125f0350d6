"""Models built on the meta device and initialized module by module (hydraddp.parallel.meta_init) hold, to the
bit, what the model built whole under the same seed holds: in one process, and sharded on 2 ranks under fsdp and fsdp2
(and whole under ddp), whatever order the modules are materialized in. What cannot be replayed says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hydraddp.distributed as idist
from hydraddp.parallel.meta_init import NotReplayable, build_on_meta
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


def whole_and_meta(factory) -> tuple[nn.Module, torch.Tensor, nn.Module, object, torch.Tensor]:
    """The model built whole and on meta under the same seed, with the generator's next draw after each."""
    torch.manual_seed(SEED)
    whole = factory()
    after_whole = torch.rand(4)
    torch.manual_seed(SEED)
    meta, replay = build_on_meta(factory)
    after_meta = torch.rand(4)
    return whole, after_whole, meta, replay, after_meta


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_model_built_on_meta_gets_the_whole_builds_values_in_any_order(name):
    whole, after_whole, meta, replay, after_meta = whole_and_meta(FACTORIES[name])
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
        self.scale = nn.Parameter(torch.randn(4))  # made by a factory: made again, from the generator's state then


class ReinitializedAfterConstruction(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        for layer in (self.first, self.second):  # GPT-2-style init after construction, outside reset_parameters
            nn.init.normal_(layer.weight, std=0.02)


class TruncNormalAfterConstruction(nn.Module):
    """ViT-style: torch.nn.init.trunc_normal_ (like orthogonal_, dirac_, sparse_) returns early on a meta tensor."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        self.pos = nn.Parameter(torch.zeros(1, 4, 8))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.mix = nn.Linear(6, 6)
        nn.init.orthogonal_(self.mix.weight)


class TemporaryDraw(nn.Module):
    """A draw into a tensor the model does not keep: the whole build's later draws follow it."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        noise = torch.empty(5)
        noise.uniform_()
        _ = torch.randn(7)
        self.first = nn.Linear(4, 4)  # the first one's draws were made, and are dropped with it
        self.second = nn.Linear(4, 4)


class WrittenThroughViewsAndAliases(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.head.weight.data.zero_()  # through a .data alias
        with torch.no_grad():
            self.head.bias[1:].fill_(0.5)  # through a view
            self.head.bias.mul_(2)
        weight = torch.empty(3, 4)
        nn.init.kaiming_uniform_(weight)
        self.extra = nn.Parameter(weight)  # drawn before it became a parameter
        self.register_buffer("flag", torch.empty(2, dtype=torch.bool))
        self.flag.fill_(True)
        self.register_buffer("count", torch.empty(3, dtype=torch.long))
        self.count.random_(0, 9)


EXACT = {"draws_in_init": DrawsInInit, "reinitialized": ReinitializedAfterConstruction,
         "trunc_normal": TruncNormalAfterConstruction, "temporary_draw": TemporaryDraw,
         "views_and_aliases": WrittenThroughViewsAndAliases}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_writes_after_construction_are_replayed_op_by_op_to_the_bit(name):
    whole, after_whole, meta, replay, after_meta = whole_and_meta(EXACT[name])
    assert torch.equal(after_whole, after_meta)
    replay.materialize(meta)
    expected, got = tensors(whole), tensors(meta)
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


class ComputedInInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4) * 0.5)  # computed from a draw: no step makes it


class CausalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("causal", torch.tril(torch.ones(4, 4)).bool())


class CopiedFromComputed(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        with torch.no_grad():
            self.linear.weight.copy_(torch.eye(4) * 2)


class OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        nn.init.normal_(self.linear.weight, generator=torch.Generator().manual_seed(1))


class DrawsFromComputed(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.keep = torch.bernoulli(torch.full((4,), 0.5) * 1.5)  # how many values it draws depends on nothing,
        # but what it draws from is computed here


class Reseeds(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)


class PartlyWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3))
        with torch.no_grad():
            self.weight[:2].normal_()  # the other rows keep torch.empty's bytes


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


class SharedStorage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.second.weight = nn.Parameter(self.first.weight.data)  # two parameters, one storage


class AsksIsMeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        if not self.linear.weight.is_meta:  # skips on the meta device what a whole build does
            nn.init.zeros_(self.linear.weight)


@pytest.mark.parametrize("factory, reason", [
    (ComputedInInit, "scale (ComputedInInit) is not set by any reset_parameters() or Hugging Face _init_weights"),
    (CausalMask, "causal (CausalMask) is not set by any reset_parameters()"),
    (PartlyWritten, "weight (PartlyWritten) is not set by any"),
    (CopiedFromComputed, "linear.weight (Linear), written at test_meta_init.py:"),
    (CopiedFromComputed, "copy_ computes it from another tensor made during construction"),
    (OwnGenerator, "linear.weight (Linear), written at test_meta_init.py:"),
    (OwnGenerator, "drawn from a torch.Generator of its own"),
    (DrawsFromComputed, "in DrawsFromComputed.__init__: bernoulli draws random numbers from tensors computed"),
    (Reseeds, "reseeds or draws from the CPU random generator"),
    (Tied, "embed.weight and head.weight are one tensor (tied weights)"),
    (SharedStorage, "second.weight (Linear) shares its storage with first.weight (Linear)"),
    (AsksIsMeta, "asks whether a tensor is on the meta device during construction"),
])
def test_a_model_whose_initialization_cannot_be_replayed_says_which_module_and_why(factory, reason):
    start = torch.get_rng_state()
    with pytest.raises(NotReplayable) as raised:
        build_on_meta(factory)
    assert reason in str(raised.value)
    if factory is not Reseeds:
        assert torch.equal(start, torch.get_rng_state())  # a refusal leaves the generator for the whole build


def test_a_module_left_with_meta_tensors_and_no_recorded_steps_is_an_error_naming_it():
    torch.manual_seed(SEED)
    model, replay = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    model.append(nn.Linear(4, 2, device="meta"))  # not in the model build_on_meta recorded
    with pytest.raises(NotReplayable, match=r"2\.weight \(Linear\) has no storage and no recorded initialization"):
        replay.materialize(model)
    model[2] = nn.Linear(4, 2)  # with real values it is not the replay's to set
    replay.materialize(model)
    assert not any(t.is_meta for t in tensors(model).values())


def test_a_tensor_a_recorded_step_leaves_unset_is_an_error_not_nan():
    torch.manual_seed(SEED)
    model, replay = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4)))
    model[0].register_buffer("extra", torch.empty(3, device="meta"))  # added after the build: no step sets it
    with pytest.raises(NotReplayable, match=r"0\.extra \(Linear\) has no storage and was not in the model"):
        replay.materialize(model)


def test_a_module_swapped_for_another_class_under_its_name_keeps_its_record():
    """SyncBatchNorm conversion makes new modules holding the same tensors under the same names."""
    torch.manual_seed(SEED)
    whole = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    torch.manual_seed(SEED)
    model, replay = build_on_meta(lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    replay.bind(model)
    replay.materialize(model)
    assert isinstance(model[1], nn.SyncBatchNorm)
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in model.state_dict().items())


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
    out = pools.run("tests.parallel.test_meta_init:sharded_from_meta", name, ["fsdp2", "fsdp", "ddp"])
    for rank in (0, 1):
        for wrap, seen in out[rank].items():
            assert seen == {"wrapper": wrap, "init_device": "meta", "keys_match": True, "differ": []}, (rank, wrap)


def test_init_device_meta_that_cannot_be_replayed_is_refused_before_launch():
    """model.init_device=meta is a promise: the launch tries the build on the meta device and refuses it (exit 2)."""
    from omegaconf import OmegaConf

    from hydraddp.config.compose import compose
    from hydraddp.preflight.model import model_problems

    cfg = compose(["wrap=fsdp2", "model.init_device=meta"])
    assert model_problems(cfg, []) == []  # the MLP replays
    cfg.model = OmegaConf.create({"_target_": f"{__name__}.ComputedInInit", "init_device": "meta", "sync_bn": False,
                                  "pretrained": None})
    [problem] = model_problems(cfg, [])
    assert problem.keys == ("model.init_device",)
    assert "model.init_device=meta: scale (ComputedInInit) is not set by any reset_parameters()" in problem.message
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
    out = pools.run("tests.parallel.test_meta_init:trained_from_meta", name, ["ddp", "fsdp", "fsdp2"])
    for wrap, seen in out[0].items():
        assert seen["losses"] == pytest.approx(expected_losses, abs=1e-5), wrap
        worst = max((seen["params"][k] - expected[k].float()).abs().max().item() for k in expected)
        assert worst <= 1e-5, (wrap, worst)
    assert out[0]["fsdp2"]["losses"] == out[1]["fsdp2"]["losses"]


class OtherNorm(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def test_a_module_whose_hugging_face_step_chose_by_its_class_cannot_be_swapped_for_another_class():
    torch.manual_seed(SEED)
    model, replay = build_on_meta(small_llama)
    model.model.norm = OtherNorm(model.model.norm.weight)  # the same tensor, another class
    with pytest.raises(NotReplayable, match=r"model\.norm \(OtherNorm\) replaced a LlamaRMSNorm after build_on_meta"):
        replay.bind(model)
