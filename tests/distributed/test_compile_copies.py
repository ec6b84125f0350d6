"""A model compiled by ``trainer.compile=true`` copies as a model does: ``copy.deepcopy`` and ``AveragedModel`` (EMA)
run the copy's own weights, and pickling works (the compile is made again where the model lands)."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from hydraddp.parallel.policies import compile_blocks, compile_module
from hydraddp.models.gpt import GPT

pytestmark = pytest.mark.slow  # Inductor compiles C++ for each copy: about 10 s each here


def eager(module: nn.Module, *args):
    return type(module).forward(module, *args)  # the class's forward: no compile


def test_a_deepcopy_and_an_averaged_model_of_a_compiled_model_run_their_own_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    compile_module(model)
    x = torch.randn(4, 8)
    assert torch.allclose(model(x), eager(model, x), atol=1e-6)
    twin = copy.deepcopy(model)
    ema = AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    with torch.no_grad():
        for p in (*twin.parameters(), *ema.module.parameters()):
            p.mul_(2.0)
    for copied in (twin, ema.module):
        assert torch.allclose(copied(x), eager(copied, x), atol=1e-6)  # its own weights, compiled
        assert not torch.allclose(copied(x), model(x))  # not the original's
    restored = pickle.loads(pickle.dumps(model))
    assert torch.allclose(restored(x), model(x), atol=1e-6)


def uncompiled(model: nn.Module) -> nn.Module:
    plain = copy.deepcopy(model)
    for module in plain.modules():
        module.__dict__.pop("forward", None)  # back to the class's eager forward
    return plain


def test_compiled_blocks_copy_with_their_model():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, dim=16, depth=2, heads=2, seq_len=8)
    assert compile_blocks(model, ["GPTBlock"]) == ["blocks.0", "blocks.1"]
    tokens = torch.randint(0, 32, (2, 8))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.add_(0.5)
    assert torch.allclose(twin(tokens), uncompiled(twin)(tokens), atol=1e-4)  # Inductor fuses: not bit for bit
    assert not torch.allclose(twin(tokens), model(tokens))
    restored = pickle.loads(pickle.dumps(model))
    assert torch.allclose(restored(tokens), model(tokens), atol=1e-5)
