"""auto_model with wrap=None picks the wrapper ignite 0.5.5 picks, checked against ignite itself."""

import pytest
import torch
from torch import nn

import hydraddp.distributed as idist
from tests.distributed.workers import mlp


def test_one_process_stays_unwrapped_like_ignite():
    import ignite.distributed as ignite_idist

    assert type(ignite_idist.auto_model(mlp())) is type(idist.auto_model(mlp())) is nn.Sequential


def test_two_gloo_ranks_get_ddp_like_ignite(pools):
    results = pools.run("tests.distributed.workers:ignite_choice")
    for rank in (0, 1):
        assert results[rank]["ignite"] == results[rank]["hydraddp"] == "DistributedDataParallel"
        assert results[rank]["use_fsdp"] == "fsdp2"  # use_fsdp=True means FSDP2, as in the seed


class RecordingDataParallel(nn.Module):
    """Stands in for DataParallel: this CPU machine has no GPUs to build the real one on."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.module, self.kwargs = module, kwargs


def test_several_gpus_without_a_process_group_get_dataparallel_like_ignite(monkeypatch):
    import ignite.distributed as ignite_idist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.nn.parallel, "DataParallel", RecordingDataParallel)
    monkeypatch.setattr(torch.nn, "DataParallel", RecordingDataParallel)
    # A model without parameters: nothing to move to the (absent) CUDA device.
    ours = idist.auto_model(nn.Identity(), output_device=0)
    theirs = ignite_idist.auto_model(nn.Identity(), output_device=0)
    assert type(theirs) is type(ours) is RecordingDataParallel
    assert ours.kwargs == theirs.kwargs == {"output_device": 0}


def test_use_fsdp_conflicting_with_wrap_is_refused():
    with pytest.raises(ValueError, match="use_fsdp=True means wrap='fsdp2', but wrap='ddp'"):
        idist.auto_model(mlp(), use_fsdp=True, wrap="ddp")
