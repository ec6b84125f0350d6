"""Reading a checkpoint runs no code it holds: DCP's ``.metadata`` index is a pickle, read with a restricted
unpickler (no process group needed: DCP's single-process save and load)."""

import os
import pickle
import warnings

import pytest
import torch
from torch import nn

from hydraddp.train.checkpoint import CheckpointError, check_readable, reader


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)  # what a planted index would do on an unrestricted pickle.load


@pytest.fixture
def saved(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "step_00000001", no_dist=True)
    return tmp_path / "step_00000001", model


def test_a_real_index_is_read_and_loads(saved):
    import torch.distributed.checkpoint as dcp

    path, model = saved
    assert sorted(check_readable(path)) == sorted(f"model.{k}" for k in model.state_dict())
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, storage_reader=reader(path), no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


def test_an_index_that_names_code_is_refused_without_running_it(saved, tmp_path):
    path, _ = saved
    marker = tmp_path / "the-payload-ran"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"corrupt or incomplete DCP checkpoint \(UnpicklingError: a checkpoint "
                                              r"index may not name posix\.mkdir"):
        check_readable(path)
    assert not marker.exists()


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint.planner", "SavePlan"),  # a DCP class, but none an index holds
    ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),  # once let through: any class of a DCP module
    ("torch.distributed.checkpoint.metadata", "field"),  # a name the metadata module imports, not its own class
])
def test_only_the_classes_the_unpickler_names_are_built(saved, module, name):
    """The unpickler allows exactly the classes it names: a pickle that asks for another class of DCP's own modules
    is refused as surely as one that asks for ``os.mkdir``."""
    path, _ = saved
    # A pickle that only names the global (protocol 2: GLOBAL opcode), then stops: building it is the question.
    (path / ".metadata").write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b".")
    with pytest.raises(CheckpointError, match=f"index may not name {module}.{name}"):
        check_readable(path)
