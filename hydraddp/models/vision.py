"""torchvision models by name, with random weights (nothing downloaded): ``model=resnet18``.

ResNets have BatchNorm: under a mixed precision, FSDP keeps each BatchNorm computing in fp32 in a unit of its own
(FSDP1 by itself, FSDP2 through hydraddp), and ``model.sync_bn=true`` makes it SyncBatchNorm on GPUs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _torchvision() -> Any:
    try:
        import torchvision
    except ImportError as exc:
        raise ImportError(f"torchvision models need torchvision ({exc}): pip install 'hydraddp[vision]'") from None
    except RuntimeError as exc:  # its compiled ops are for another torch build
        raise ImportError(
            f"torchvision does not load beside this torch ({torch.__version__}): {exc}. torch and torchvision must be "
            "a matching pair of builds; PyPI's torchvision is a CUDA build, which fails beside a CPU-only torch. "
            "Install them together, e.g. pip install torch==2.14.1 torchvision==0.29.1") from None
    return torchvision


def torchvision_model(name: str = "resnet18", **kwargs: Any) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None, **kwargs)``, e.g. ``num_classes=10``."""
    return _torchvision().models.get_model(name, weights=None, **kwargs)
