"""``model.pretrained=PATH``: a run that starts from trained weights, streamed from storage into each rank's shards.

PATH is either
- a Hugging Face model directory (``config.json`` and ``*.safetensors``, one file or sharded with an index), for a
  transformers model (``model=hf_causal_lm``). Its ``config.json`` is the architecture: the launch takes the model's
  sizes from it (``models.hf.from_hf_config``), and a size typed on the command line that contradicts it is refused. The tensors
  are read by DCP's ``HuggingFaceStorageReader``, each rank only the slices its shards hold, and cast into the model's
  dtype (a bf16 file into fp32 master weights);
- a hydraddp checkpoint (``step_NNNNNNNN``), for any model: its weights only. The optimizer starts fresh at step 0,
  in a new MLflow run tagged ``hydraddp.pretrained``.

The launch checks PATH against the model of the config (``models.of_config``), on the meta device, before any worker
starts (``preflight.model.model_problems``, with ``handoff.pretrained.mismatch``); the workers load it after wrapping
(``load``), where a resume would have loaded a checkpoint instead.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from hydraddp.handoff.dcp_index import reader
from hydraddp.handoff.pretrained import expected_keys, kind


def load(path: str | Path, model: nn.Module) -> None:
    """Fill ``model`` (wrapped: DDP, FSDP1, FSDP2 or none) from ``path``, each rank reading the parts its own tensors
    hold. A collective under a process group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

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
