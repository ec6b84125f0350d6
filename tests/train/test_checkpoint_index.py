"""Reading a checkpoint runs no code it holds: DCP's ``.metadata`` index is a pickle, read with a restricted
unpickler (no process group needed: DCP's single-process save and load)."""

import os
import pickle
import warnings

import pytest
import torch
from torch import nn

from hydraddp.handoff.checkpoints import CheckpointError, check_readable
from hydraddp.handoff.dcp_index import reader

# What an index holds depends on the Python that pickled it, to its patch level: every claimed Python runs these.
pytestmark = pytest.mark.every_python


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


def _written_as(path, *, enum_members_by_name=False, paths_module=None):
    """``path``'s own index pickled again as another Python writes it: Python 3.11.0-3.11.4 (Debian 12's 3.11.2)
    pickle an enum member as ``getattr(EnumClass, name)``; 3.13 names its paths' classes in ``pathlib._local``.
    Protocol 2 writes each global as text (the GLOBAL opcode), so a module's name can be swapped in place."""
    import enum
    import io

    index = pickle.loads((path / ".metadata").read_bytes())  # our own file: trusted here

    class As3112(pickle.Pickler):
        def reducer_override(self, obj):
            if enum_members_by_name and isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    out = io.BytesIO()
    As3112(out, protocol=2, fix_imports=False).dump(index)  # "builtins", not Python 2's "__builtin__"
    data = out.getvalue()
    if enum_members_by_name:
        assert b"cbuiltins\ngetattr\n" in data  # what Debian 12's Python writes
    if paths_module is not None:
        written = next(m for m in (b"pathlib", b"pathlib._local") if b"c%s\nPosixPath\n" % m in data)
        data = data.replace(b"c%s\nPosixPath\n" % written, f"c{paths_module}\nPosixPath\n".encode())
    (path / ".metadata").write_bytes(data)


@pytest.mark.parametrize("python, written", [
    ("3.11.2", {"enum_members_by_name": True}),
    ("3.13", {"paths_module": "pathlib._local"}),
    ("3.11.7", {"paths_module": "pathlib"}),  # as 3.11 and 3.12 name them, read on 3.13 too
])
def test_an_index_as_every_claimed_python_writes_it_is_read_and_loads(saved, python, written):
    """A checkpoint written on another Python (a requeued job on another node's image, shared storage) resumes: the
    index as Debian 12's 3.11.2 and Debian 13's 3.13 pickle it. (CI also writes and reads real ones on each Python:
    scripts/pythons.sh.)"""
    import torch.distributed.checkpoint as dcp

    path, model = saved
    _written_as(path, **written)
    assert sorted(check_readable(path)) == sorted(f"model.{k}" for k in model.state_dict())
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, storage_reader=reader(path), no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("call", [
    b"ctorch\nSize\nX\x07\x00\x00\x00__new__\x86R.",  # getattr(torch.Size, "__new__"): not an enum
    b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nX\x08\x00\x00\x00__init__\x86R.",  # no member
])
def test_getattr_builds_only_a_member_of_an_allowed_enum(saved, call):
    path, _ = saved
    (path / ".metadata").write_bytes(b"\x80\x02cbuiltins\ngetattr\n" + call)
    with pytest.raises(CheckpointError, match=r"index may not call getattr\(.*only a member of an allowed enum"):
        check_readable(path)
