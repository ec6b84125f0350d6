"""torchvision's ResNet-18 built on the meta device holds its whole build's values to the bit (parameters and
BatchNorm statistics): torchvision re-initializes every convolution and norm after construction (``kaiming_normal_``,
``constant_``, and with ``zero_init_residual`` each block's last BatchNorm), which the meta build replays operation by
operation (``hydraddp.parallel.meta_init``). One process, no launch.

Runs in the vision venv (see test_resnet.py); in the main venv it is skipped, saying so.
"""

from __future__ import annotations

import pytest
import torch

try:
    from hydraddp.models.vision import _torchvision

    _torchvision()
except ImportError as exc:
    pytest.skip(f"no torchvision that loads beside this torch ({exc.__class__.__name__}); scripts/dev.sh test "
                "runs these tests in a venv of its own", allow_module_level=True)


@pytest.mark.parametrize("zero_init_residual", [False, True])
def test_resnet18_built_on_meta_is_its_whole_build_to_the_bit(zero_init_residual):
    from hydraddp.parallel.meta_init import build_on_meta
    from hydraddp.models.vision import torchvision_model

    def factory() -> torch.nn.Module:
        return torchvision_model("resnet18", num_classes=10, zero_init_residual=zero_init_residual)

    torch.manual_seed(0)
    whole = factory()
    after_whole = torch.rand(4)
    torch.manual_seed(0)
    model, replay = build_on_meta(factory)
    assert torch.equal(after_whole, torch.rand(4))  # the generator is left where the whole build leaves it
    for module in reversed(list(model.modules())):  # any order: each module from its own recorded state
        replay.materialize_module(module)
    expected = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    got = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
