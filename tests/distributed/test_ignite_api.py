"""``hydraddp.distributed`` is ignite 0.5.5's ``idist``: every public name, its signature, its input checks, and
the cases a switching user hit (flags that were functions, a hang on env ranks without MASTER_PORT, ``group=``)."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import textwrap
import types

import ignite.distributed as ignite_idist
import pytest

import hydraddp.distributed as idist
from tests.helpers.spawn import REPO, run_together


def _ignite_public_names() -> list[str]:
    names = [*ignite_idist.utils.__all__, *ignite_idist.auto.__all__, *ignite_idist.launcher.__all__]
    return sorted({*names, "native", "xla", "comp_models", "utils", "auto", "launcher"})


def _compatible(theirs: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """What an ignite call could do that ours refuses: a parameter missing, moved or with another default."""
    ours_params = list(ours.parameters.values())
    problems = []
    for index, param in enumerate(theirs.parameters.values()):
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            if not any(p.kind is param.kind for p in ours_params):
                problems.append(f"{param} missing")
            continue
        match = ours.parameters.get(param.name)
        if match is None:
            problems.append(f"{param.name} missing")
        elif param.kind is param.POSITIONAL_OR_KEYWORD and ours_params.index(match) != index:
            problems.append(f"{param.name} at position {ours_params.index(match)}, ignite's at {index}")
        elif match.default != param.default:
            problems.append(f"{param.name} defaults to {match.default!r}, ignite's to {param.default!r}")
    return problems


@pytest.mark.parametrize("name", _ignite_public_names())
def test_every_public_name_of_ignite_exists_with_a_call_ignite_accepts(name):
    theirs, ours = getattr(ignite_idist, name), getattr(idist, name)
    if isinstance(theirs, types.ModuleType):
        assert isinstance(ours, types.ModuleType)
    elif isinstance(theirs, bool):
        assert isinstance(ours, bool)
    elif inspect.isclass(theirs):
        assert inspect.isclass(ours)
        assert not _compatible(inspect.signature(theirs), inspect.signature(ours))
        for method in ("run", "__enter__", "__exit__", "set_epoch", "__iter__", "__len__"):
            if hasattr(theirs, method):
                assert not _compatible(inspect.signature(getattr(theirs, method)),
                                       inspect.signature(getattr(ours, method))), method
    elif callable(theirs):
        assert callable(ours)
        assert not _compatible(inspect.signature(theirs), inspect.signature(ours))


def test_support_flags_are_booleans_as_in_ignite():
    assert idist.has_native_dist_support is True
    assert idist.has_xla_support is False
    assert idist.has_hvd_support is (importlib.util.find_spec("horovod") is not None)
    assert idist.model_name() == "serial"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(backend="abc"), "Unknown backend 'abc'. Available backends:"),
    (dict(nnodes=2), "If backend is None, argument 'nnodes' should be also None, but given 2"),
    (dict(backend="gloo", nproc_per_node=-1), "Argument nproc_per_node should positive, but given -1"),
    (dict(backend="gloo", nproc_per_node=1, nnodes=-1), "Argument nnodes should positive, but given -1"),
    (dict(backend="gloo", nproc_per_node=1, nnodes=2), "arguments node_rank should be given"),
    (dict(backend="gloo", nproc_per_node=1, nnodes=2, node_rank=2), "node_rank should be between 0 and 1"),
    (dict(backend="gloo", nproc_per_node=1, nnodes=2, node_rank=1), "arguments master_addr and master_port"),
    (dict(backend="gloo", nproc_per_node=1, init_method="tcp://10.1.1.20:23456"), "will hang. To fix this"),
    (dict(backend="xla-tpu", nproc_per_node=8), "'xla-tpu' (XLA/TPU) is not supported by hydraddp"),
])
def test_parallel_refuses_what_ignite_refuses_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError) as caught:
        idist.Parallel(**kwargs)
    assert message in str(caught.value)


def test_xla_asked_for_anywhere_fails_clearly():
    for call in (lambda: idist.initialize("xla-tpu"), lambda: idist.spawn("xla-tpu", print, (), nproc_per_node=8)):
        with pytest.raises(ValueError, match=r"'xla-tpu' \(XLA/TPU\) is not supported by hydraddp; use 'nccl' or"):
            call()


def test_the_serial_model_answers_as_ignites():
    assert idist.new_group([0]) == [0]
    assert idist.all_gather("x") == ["x"] and idist.all_reduce(3, group=[0]) == 3
    with pytest.raises(ValueError, match="Argument ranks should be list of int"):
        idist.new_group(1)
    with pytest.raises(ValueError, match="Argument tensor should not be None"):
        idist.broadcast(None)
    calls = []
    idist.one_rank_only()(lambda: calls.append(1))()
    assert calls == [1]


def test_groups_and_broadcast_rules_on_two_real_ranks(pools):
    results = pools.run("tests.distributed.workers:groups_and_broadcast")
    assert results[0] == {"group_sum": None, "list_group_sum": [3], "group_gather": [0, 1], "objects_in_group": [{"r": 0}, {"r": 1}],
                          "outside_gather": [0], "broadcast_none": "Source data can not be None",
                          "broadcast_number": 5.0, "broadcast_list": "Unhandled input type <class 'list'>",
                          "bad_group": "Argument group should be list of int or ProcessGroup"}
    assert results[1]["group_sum"] == [1] and results[1]["outside_gather"] == [1]
    assert results[1]["broadcast_none"].startswith("Argument safe_mode should be True")


ENV_RANKS_SCRIPT = textwrap.dedent("""
    import hydraddp.distributed as idist

    def fn(local_rank):
        print("RESULT", idist.get_rank(), idist.get_world_size(), idist.all_reduce(idist.get_rank() + 1), flush=True)

    if __name__ == "__main__":
        with idist.Parallel(backend="gloo") as parallel:
            parallel.run(fn)
""")


def test_env_ranks_without_master_port_meet_on_one_port(tmp_path):
    """RANK/LOCAL_RANK/WORLD_SIZE set, MASTER_PORT not: every rank must pick the same port (ignite's 15000)."""
    script = tmp_path / "env_ranks.py"
    script.write_text(ENV_RANKS_SCRIPT)
    commands = [(["env", "-u", "MASTER_PORT", "-u", "MASTER_ADDR", f"RANK={rank}", f"LOCAL_RANK={rank}", "WORLD_SIZE=2",
                  sys.executable, str(script)], REPO) for rank in (0, 1)]
    ranks = run_together(commands, timeout=30)
    results = sorted(line for rank in ranks for line in rank.stdout.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT 0 2 3", "RESULT 1 2 3"], [rank.stderr[-2000:] for rank in ranks]


def test_comp_models_has_ignites_names():
    from ignite.distributed import comp_models as theirs

    from hydraddp.distributed import comp_models as ours

    for name in ("registered_computation_models", "setup_available_computation_models", "has_native_dist_support",
                 "has_xla_support", "has_hvd_support", "_SerialModel"):
        assert hasattr(ours, name), name
    ours_names = [cls.name for cls in ours.registered_computation_models]
    theirs_names = [cls.name for cls in theirs.registered_computation_models if cls.name != "xla-dist"]
    assert ours_names == ["serial", "native-dist", "horovod-dist"]  # Horovod's always: imported only when used
    assert theirs_names == [name for name in ours_names if name in theirs_names]  # ignite's, where Horovod imports
    for name in ("NCCL", "GLOO", "MPI", "has_native_dist_support", "_NativeDistModel"):
        assert hasattr(ours.native, name), name
    assert ours.base._SerialModel().get_world_size() == 1 and ours.base._torch_version_gt_112


def test_the_native_path_never_imports_horovod():
    """``has_hvd_support`` is a boolean, but Horovod is imported only when someone reads it or asks for it."""
    code = ("import sys, hydraddp.distributed as idist; idist.Parallel(backend='gloo', nproc_per_node=2); "
            "idist.get_rank(); idist.model_name(); print('horovod' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
