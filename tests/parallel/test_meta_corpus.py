"""The meta-build contract over a corpus of models: built on the meta device (``model.init_device=meta``) and sharded,
each model is EXACT (every parameter and every buffer, non-persistent ones too, equal to the whole build's under the
same seed, to the bit) or REFUSED (``NotReplayable`` at ``build_on_meta``, naming the module). ``EXPECTED`` says which
for each model, so that a model moving from exact to different, or from refused to silently built, fails.

One pool body builds the whole corpus under fsdp2 and fsdp on 2 ranks (the shards gathered); SyncBatchNorm goes through
``auto_model(sync_bn=True)`` on one rank (sync_bn needs GPUs at 2 ranks: a configuration error on this CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import hydraddp.distributed as idist
from hydraddp.parallel.meta_init import NotReplayable, build_on_meta

SEED = 11


# --- the corpus -----------------------------------------------------------------------------------------------------

def gpt() -> nn.Module:
    from hydraddp.models.gpt import GPT

    return GPT(vocab_size=64, seq_len=16, dim=32, depth=2, heads=2)


def mlp() -> nn.Module:
    from hydraddp.models.mlp import MLP

    return MLP()


def hf(architecture: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from hydraddp.models.hf import causal_lm

        if architecture == "gpt2":
            return causal_lm("gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)
        return causal_lm(architecture, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    build.__name__ = f"hf_{architecture}"
    return build


class BasicBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNetLike(nn.Module):
    """torchvision's ResNet in small: re-initialized after construction as torchvision's ``resnet`` does it."""

    def __init__(self, channels: int = 8, num_classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.norm = nn.GroupNorm(2, channels)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        for m in self.modules():  # zero_init_residual: each block starts as the identity
            if isinstance(m, BasicBlock):
                nn.init.constant_(m.bn2.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(self.norm(x).mean((2, 3)))


class ZeroHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 10)
        nn.init.zeros_(self.head.weight)  # right after building it: the first loss is ln 10


class LoRALinear(nn.Module):
    """peft's LoRA in small (peft's own: peft_lora_llama): a frozen base, A as kaiming_uniform_, B zero."""

    def __init__(self, features: int, rank: int = 4, zero_through_data: bool = True):
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, features))
        self.lora_B = nn.Parameter(torch.empty(features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        if zero_through_data:
            self.lora_B.data.zero_()
        else:
            nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


class LoRA(nn.Module):
    def __init__(self, zero_through_data: bool = True):
        super().__init__()
        self.q = LoRALinear(16, zero_through_data=zero_through_data)
        self.v = LoRALinear(16, zero_through_data=zero_through_data)


class NormalReinit(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        nn.init.normal_(self.proj.weight, std=0.02)  # the Linear just built
        self.out = nn.Linear(16, 4)


class TruncNormalReinit(nn.Module):
    """ViT-style; torch.nn.init.trunc_normal_ returns early on a meta tensor, so it is recorded as a call."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, 16))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)


class RMSNorm(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))  # made by a factory, set by no reset_parameters


class OwnNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(16)
        self.proj = nn.Linear(16, 16)


class FlagBuffers(nn.Module):
    """Integer and bool buffers set as reset_parameters would set them: replayable."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.empty(4, dtype=torch.bool))
        self.register_buffer("steps", torch.empty(3, dtype=torch.long), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        self.mask.fill_(True)
        self.steps.zero_()


class CausalMask(nn.Module):
    """A bool buffer computed in __init__: no write makes it, so it is refused."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("causal", torch.tril(torch.ones(4, 4)).bool())


def peft_lora_llama() -> nn.Module:
    """peft's own LoRA, injected into a built Llama (after its post_init): the adapters never got its _init_weights."""
    from tests.helpers.lora import tiny_lora_llama

    return tiny_lora_llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2)


CORPUS: dict[str, Callable[[], nn.Module]] = {
    "gpt": gpt, "mlp": mlp,
    "hf_llama": hf("llama"), "hf_gpt2": hf("gpt2"), "hf_mistral": hf("mistral"), "hf_qwen2": hf("qwen2"),
    "resnet_like": ResNetLike, "zero_head": ZeroHead,
    "lora_data_zero": LoRA, "lora_init_zeros": lambda: LoRA(zero_through_data=False),
    "peft_lora_llama": peft_lora_llama,
    "normal_reinit": NormalReinit, "trunc_normal_reinit": TruncNormalReinit, "own_norm": OwnNorm,
    "flag_buffers": FlagBuffers, "causal_mask": CausalMask,
}

EXACT = "exact"
EXPECTED = {
    **{name: EXACT for name in CORPUS},
    # refused: the beginning of the NotReplayable message
    "hf_gpt2": "refused: transformer.wte.weight and lm_head.weight are one tensor (tied weights)",
    "causal_mask": "refused: causal (CausalMask) is not set by any reset_parameters()",
}


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def outcome(name: str, wrap: str | None, convert: Callable[[nn.Module], nn.Module] = lambda m: m,
            sync_bn: bool = False) -> str:
    """EXACT, ``refused: <message>``, or ``different: <tensors>``, of ``CORPUS[name]`` built on the meta device and
    wrapped by ``auto_model`` (``wrap=None``: materialized in this process, the last module first)."""
    from tests.distributed.workers import full_params

    torch.manual_seed(SEED)
    whole = convert(CORPUS[name]())
    expected = {k: v.detach().clone() for k, v in tensors(whole).items()}
    torch.manual_seed(SEED)
    try:
        model, replay = build_on_meta(CORPUS[name])
    except NotReplayable as exc:
        return f"refused: {exc}"
    model = convert(model)
    if wrap is None:
        for module in reversed(list(model.modules())):
            replay.materialize_module(module)
        got = tensors(model)
    else:
        # use_orig_params: FSDP1 flattens a frozen base (LoRA's) and trainable adapters into one unit only so.
        kwargs = {"use_orig_params": True} if wrap == "fsdp" else {}
        wrapped = idist.auto_model(model, wrap=wrap, sync_bn=sync_bn, **kwargs)
        if idist.wrap_report(wrapped).init_device != "meta":
            return "different: built whole"
        # Parameters gathered from the shards; buffers (not sharded) as they are, dtype and all.
        buffers = {k.replace("_fsdp_wrapped_module.", ""): b for k, b in wrapped.named_buffers()}
        got = {**full_params(wrapped), **buffers}
    differ = sorted(k for k in expected if k not in got or not torch.equal(expected[k], got[k].cpu()))
    return f"different: {differ}" if differ else EXACT


def matches(seen: dict[str, str], expected: dict[str, str]) -> dict[str, str]:
    """Each model's outcome as ``expected`` words it (a refusal by the beginning of its message)."""
    return {name: expected[name] if seen[name].startswith(expected.get(name, "?")) else seen[name] for name in seen}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_corpus_in_one_process(name):
    assert matches({name: outcome(name, None)}, EXPECTED) == {name: EXPECTED[name]}


def corpus_under(local_rank: int, wraps: list[str]) -> dict[str, dict[str, str]]:
    """Per wrap, the whole corpus, and the ResNet-like model converted to SyncBatchNorm after the meta build."""
    seen = {}
    for wrap in wraps:
        seen[wrap] = {name: outcome(name, wrap) for name in CORPUS}
        seen[wrap]["resnet_like_syncbn_after_build"] = outcome("resnet_like", wrap,
                                                               nn.SyncBatchNorm.convert_sync_batchnorm)
    return seen


def test_the_corpus_built_on_meta_and_sharded_on_two_ranks_is_exact_or_refused(pools):
    """fsdp2 fills each module after sharding; fsdp (FSDP1) asks for each module's values as it wraps its unit."""
    out = pools.run("tests.parallel.test_meta_corpus:corpus_under", ["fsdp2", "fsdp"], timeout=600)
    assert out[0] == out[1]
    expected = {**EXPECTED, "resnet_like_syncbn_after_build": EXACT}
    for wrap, seen in out[0].items():
        assert matches(seen, expected) == expected, wrap


def sync_bn_outcomes(local_rank: int) -> dict[str, str]:
    """``auto_model(sync_bn=True)`` on a meta build, under fsdp2 and ddp: the SyncBatchNorm modules it makes keep the
    BatchNorms' record (by name). DDP itself refuses SyncBatchNorm on the CPU, after auto_model materialized the
    model: the values are then read from the model, which the conversion changed in place."""
    from tests.distributed.workers import full_params

    torch.manual_seed(SEED)
    expected = tensors(ResNetLike())
    seen = {}
    for wrap in ("fsdp2", "ddp"):
        torch.manual_seed(SEED)
        model, _ = build_on_meta(ResNetLike)
        try:
            wrapped = idist.auto_model(model, wrap=wrap, sync_bn=True)
            got = {**full_params(wrapped), **dict(wrapped.named_buffers())}
        except ValueError as exc:  # no error on a GPU machine
            if wrap != "ddp" or "SyncBatchNorm layers only work with GPU modules" not in str(exc):
                raise
            wrapped, got = model, tensors(model)
        got = {k.removeprefix("module."): v for k, v in got.items()}
        norms = [m for m in wrapped.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        differ = sorted(k for k in expected if k not in got or not torch.equal(expected[k], got[k].cpu()))
        converted = bool(norms) and all(isinstance(m, nn.SyncBatchNorm) for m in norms)
        seen[wrap] = EXACT if converted and not differ else f"different: {differ}, converted: {converted}"
    return seen


def test_sync_bn_after_a_meta_build_materializes_to_the_whole_builds_values(pools):
    out = pools.run("tests.parallel.test_meta_corpus:sync_bn_outcomes", nproc=1, timeout=300)
    assert out[0] == {"fsdp2": EXACT, "ddp": EXACT}
