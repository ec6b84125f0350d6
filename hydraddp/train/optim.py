"""The optimizer's parameter groups: biases and normalization weights can be kept out of weight decay."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn


def _is_norm(module: nn.Module) -> bool:
    # torch's norms, and the models' own (Hugging Face's LlamaRMSNorm, ...) by the name every library gives them.
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)
    return isinstance(module, norms) or type(module).__name__.endswith("Norm")


def no_decay_names(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every bias and every parameter of a normalization module."""
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if name == "bias" or _is_norm(module):
                yield (f"{module_name}.{name}" if module_name else name), param


def parameter_groups(model: nn.Module, no_decay_norm_and_bias: bool) -> list[dict] | list[nn.Parameter]:
    """The parameters that train (``requires_grad``), or two groups of them: the rest (the optimizer's weight decay)
    and biases plus norm weights (weight decay 0). Works on the wrapped model: DDP, FSDP2's DTensors, and FSDP1
    with ``use_orig_params=True`` (``build.wrap_kwargs`` sets it), whose original parameters stay on their modules."""
    # Only what trains: a frozen parameter (a LoRA model's base) never gets a gradient, so an optimizer has nothing
    # to do with it.
    params = [p for p in model.parameters() if p.requires_grad]
    if not no_decay_norm_and_bias:
        return params
    exempt = {id(param) for _, param in no_decay_names(model)}
    return [{"params": [p for p in params if id(p) not in exempt]},
            {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0}]
