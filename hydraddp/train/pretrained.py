"""``model.pretrained=PATH``: a run that starts from trained weights, streamed from storage into each rank's shards.

PATH is either
- a Hugging Face model directory (``config.json`` and ``*.safetensors``, one file or sharded with an index), for a
  transformers model (``model=hf_causal_lm``). Its ``config.json`` is the architecture: the launch takes the model's
  sizes from it (``from_hf_config``), and a size typed on the command line that contradicts it is refused. The tensors
  are read by DCP's ``HuggingFaceStorageReader``, each rank only the slices its shards hold, and cast into the model's
  dtype (a bf16 file into fp32 master weights);
- a hydraddp checkpoint (``step_NNNNNNNN``), for any model: its weights only. The optimizer starts fresh at step 0,
  in a new MLflow run tagged ``hydraddp.pretrained``.

The launch checks PATH against the model it builds, on the meta device, before any worker starts
(``launch_plan.model_problems``, with ``mismatch``); the workers load it after wrapping (``load``), where a resume
would have loaded a checkpoint instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from hydraddp.config.instantiate import HYDRADDP_MODEL_KEYS

HF_CONFIG = "config.json"
HF_TARGET = "hydraddp.models.hf.causal_lm"
# Keys of hydraddp's hf_causal_lm node that are not the transformers config's own attributes.
HF_NODE_KEYS = ("_target_", "architecture", "attn_implementation")


class PretrainedError(ValueError):
    """``model.pretrained`` cannot start this model: the message names the path, the keys and the fix."""


def kind(path: str | Path) -> str:
    """``hf`` (a Hugging Face model directory) or ``checkpoint`` (a hydraddp checkpoint)."""
    from hydraddp.train.checkpoint import META

    path = Path(path)
    if not path.exists():
        raise PretrainedError(f"model.pretrained={path}: no such file or directory. Give a Hugging Face model "
                              "directory (config.json and *.safetensors) or a hydraddp checkpoint (step_NNNNNNNN).")
    if (path / HF_CONFIG).is_file():
        return "hf"
    if (path / META).is_file():
        return "checkpoint"
    raise PretrainedError(f"model.pretrained={path}: neither a Hugging Face model directory (no {HF_CONFIG}) nor a "
                          f"hydraddp checkpoint (no {META}).")


def typed_model_keys(overrides: list[str]) -> dict[str, str]:
    """``model.KEY=VALUE`` overrides typed on the command line: KEY -> VALUE as typed."""
    typed = {}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("model.") and key.count(".") == 1:
            typed[key.removeprefix("model.")] = value
    return typed


def from_hf_config(model_node: Any, path: Path, typed: dict[str, str]) -> None:
    """Make ``model_node`` (an hf_causal_lm node, edited in place) describe the model of ``path/config.json``: its
    ``architecture`` and every size key the config has, so that the run's parameters say what was trained. A key
    typed on the command line that contradicts the config is a ``PretrainedError`` naming both values; one the config
    does not have is passed on, as ``from_pretrained`` would; the node's defaults that the config lacks are dropped."""
    from hydraddp.models.hf import pretrained_config

    config = pretrained_config(path)
    node_keys = [k for k in model_node if k not in HF_NODE_KEYS and k not in HYDRADDP_MODEL_KEYS]
    wanted = {"architecture": config.model_type,
              **{k: getattr(config, k) for k in node_keys if hasattr(config, k)}}
    for key, value in wanted.items():
        if key in typed and _differs(model_node[key], value):
            raise PretrainedError(
                f"model.{key}={typed[key]} contradicts model.pretrained={path}: its {HF_CONFIG} has "
                f"{'model_type' if key == 'architecture' else key}={value}. Drop model.{key} (the pretrained "
                "model's config is the architecture), or start from other weights.")
        model_node[key] = value
    for key in node_keys:
        if not hasattr(config, key) and key not in typed:
            del model_node[key]


def _differs(given: Any, value: Any) -> bool:
    if isinstance(value, (list, tuple)) or isinstance(given, (list, tuple)):
        return list(given) != list(value)
    return given != value


def stored_tensors(path: Path, source: str) -> dict[str, Any]:
    """DCP's metadata of each tensor ``path`` holds, by the model's state_dict key (read from the files' headers)."""
    if source == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return dict(HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata)
    from hydraddp.train.checkpoint import check_readable

    return {key.removeprefix("model."): value for key, value in check_readable(path).items()
            if key.startswith("model.") and hasattr(value, "size")}


def expected_keys(path: Path, source: str) -> dict[str, tuple[int, ...]]:
    """The tensors ``path`` holds, by the model's state_dict key, with their shapes."""
    return {key: tuple(value.size) for key, value in stored_tensors(Path(path), source).items()}


def stored_dtypes(path: str | Path, source: str) -> list[Any]:
    """The dtype of each tensor ``path`` holds."""
    return [value.properties.dtype for value in stored_tensors(Path(path), source).values()]


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key of a tensor that several keys share (tied embeddings) -> all of its keys."""
    by_tensor: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(key)
    return {key: keys for keys in by_tensor.values() if len(keys) > 1 for key in keys}


def mismatch(path: Path, source: str, model: nn.Module) -> str | None:
    """What stops ``path`` from filling ``model`` (built whole or on the meta device): missing or unexpected keys, or
    a shape, the first of each named; None when it fits."""
    stored = expected_keys(path, source)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = aliases(model)
    missing = sorted(k for k in state if k not in stored and not any(a in stored for a in tied.get(k, ())))
    unexpected = sorted(k for k in stored if k not in state)
    if missing or unexpected:
        return (f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)}), unexpected "
                f"{unexpected[:3]}{' ...' if len(unexpected) > 3 else ''} ({len(unexpected)})")
    for key, shape in stored.items():
        if state[key] != shape:
            return f"{key} has shape {shape} there but {state[key]} in this model"
    return None


def load(path: str | Path, model: nn.Module) -> None:
    """Fill ``model`` (wrapped: DDP, FSDP1, FSDP2 or none) from ``path``, each rank reading the parts its own tensors
    hold. A collective under a process group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from hydraddp.train.checkpoint import reader

    path = Path(path)
    source = kind(path)
    state = get_model_state_dict(model)  # templates, sharded as this run shards them
    stored = expected_keys(path, source)
    # A tied key the file leaves out (lm_head.weight beside embed_tokens.weight) is filled through its alias.
    state = {k: v for k, v in state.items() if k in stored}
    distributed = dist.is_available() and dist.is_initialized()
    if source == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not distributed)
    else:
        wrapped = {"model": state}
        dcp.load(wrapped, storage_reader=reader(path), no_dist=not distributed)
        state = wrapped["model"]
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))  # the tied aliases left out above
