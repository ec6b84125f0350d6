"""Parallel on real processes: spawn through torch's elastic agent, attach under torchrun, fail clearly,
stop every worker on Ctrl-C, and span two "nodes" on loopback."""

import json
import sys
import textwrap

import pytest

import hydraddp.distributed as idist
from hydraddp.distributed.env import free_port
from tests.helpers.spawn import REPO, interrupt_when, rendezvous_port, run_parallel, run_process, run_together

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    return run_parallel("tests.distributed.workers:collectives", tmp_path=tmp_path_factory.mktemp("c"))


def test_spawned_workers_see_a_real_group(collected):
    assert sorted(collected) == [0, 1]
    for rank, out in collected.items():
        assert (out["rank"], out["local_rank"], out["world_size"]) == (rank, rank, 2)
        assert (out["nproc_per_node"], out["nnodes"], out["node_rank"], out["backend"]) == (2, 1, 0, "gloo")
        assert out["device"] == "cpu"


def test_collectives_follow_ignite_types(collected):
    for out in collected.values():
        assert out["sum_int"] == 3 and isinstance(out["sum_int"], int)
        assert out["max_float"] == 2.5
        assert out["avg_tensor"] == [0.5, 2.0]
        assert out["gather_tensor"] == [0, 0, 1, 1]
        assert out["gather_number"] == [0, 10]
        assert out["gather_str"] == ["r0", "r1"]
        assert out["gather_dict"] == [{"rank": 0}, {"rank": 1}]
        assert out["broadcast_tensor"] == [8]
        assert out["broadcast_str"] == "from0"
        assert out["broadcast_safe"] == "only-src"


def test_cpu_workers_get_one_thread_each_unless_the_user_chose(collected, tmp_path):
    assert all(out["omp_env"] == "1" and out["threads"] == 1 for out in collected.values())
    chosen = run_parallel("tests.distributed.workers:collectives", tmp_path=tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert all(out["omp_env"] == "2" and out["threads"] == 2 for out in chosen.values())


def test_a_raising_worker_is_one_clear_error_naming_its_rank(tmp_path):
    failure = run_parallel("tests.distributed.workers:fail_on_rank", 1, tmp_path=tmp_path, expect_failure=True)
    assert failure["rank"] == 1
    assert failure["error"] == "ValueError: boom on rank 1"
    assert failure["message"] == "rank 1 failed: ValueError: boom on rank 1"
    assert "fail_on_rank" in failure["traceback"]


def test_a_worker_that_cannot_exit_is_ended_with_its_stacks_after_the_grace(tmp_path):
    """Its work done, a worker hung in its exit (a thread that never ends, which the exit joins): torch's agent waits
    for it with no limit. Past ``EXIT_GRACE_S`` it ends with exit code 1, its threads' stacks in its stderr."""
    failure = run_parallel("tests.distributed.workers:leave_a_thread_that_never_ends", 2.0, tmp_path=tmp_path,
                           expect_failure=True, timeout=90)  # a guard: the hang it tests would reach it
    assert failure["exitcode"] == 1
    assert failure["error"] == ('its work was done, but it did not exit within 2 s; the stacks of its threads follow '
                                '"Timeout" in its stderr (its log)')
    assert "Timeout (0:00:02)!" in failure["stderr"]
    assert 'in never_ending_thread_forever' in failure["stderr"]  # the stuck thread, named by its function


def test_serial_and_explicit_port(tmp_path):
    assert idist.Parallel(backend=None).run(lambda local_rank, x: x * 2, 21) == {0: 42}
    results = run_parallel("tests.distributed.workers:collectives", tmp_path=tmp_path, master_port=free_port())
    assert sorted(results) == [0, 1]


def test_initialize_without_a_launcher_is_a_world_of_one():
    idist.initialize("gloo")
    try:
        assert (idist.get_world_size(), idist.get_rank(), idist.backend()) == (1, 0, "gloo")
        assert idist.all_reduce(3) == 3
    finally:
        idist.finalize()
    assert idist.backend() is None and idist.model_name() == "serial"


ATTACH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import hydraddp.distributed as idist

    def fn(local_rank):
        return {"rank": idist.get_rank(), "local_rank": local_rank, "world": idist.get_world_size(),
                "pid": os.getpid(), "nproc": idist.get_nproc_per_node()}

    if __name__ == "__main__":
        # nproc_per_node is ignored under torchrun: it attaches instead of spawning more workers.
        out = idist.Parallel(backend="gloo", nproc_per_node=2).run(fn)
        # One file per rank: two processes printing to one pipe can interleave their lines.
        rank, result = next(iter(out.items()))
        with open(f"{sys.argv[1]}/result{rank}.json", "w") as f:
            json.dump(result, f)
""")


def test_under_torchrun_run_attaches_instead_of_spawning(tmp_path):
    script = tmp_path / "attach.py"
    script.write_text(ATTACH_SCRIPT)
    launched = run_process([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                            f"--master_port={free_port()}", str(script), str(tmp_path)], timeout=120)
    assert launched.returncode == 0, launched.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world"] == 2 and r["nproc"] == 2 for r in results)
    assert len({r["pid"] for r in results}) == 2  # two processes, the ones torchrun started


NODE_SCRIPT = textwrap.dedent("""
    import sys
    import hydraddp.distributed as idist

    def fn(local_rank):
        return (idist.get_rank(), idist.get_world_size(), idist.all_reduce(idist.get_rank() + 1))

    if __name__ == "__main__":
        node_rank, endpoint = int(sys.argv[1]), sys.argv[2]
        out = idist.Parallel(backend="gloo", nproc_per_node=1, nnodes=2, node_rank=node_rank,
                             rdzv_endpoint=endpoint).run(fn)
        print("RESULT", list(out.values())[0], flush=True)
""")


def test_two_nodes_on_loopback_train_as_one_world(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    endpoint = f"127.0.0.1:{rendezvous_port()}"
    nodes = run_together([([sys.executable, str(script), str(i), endpoint], REPO) for i in (0, 1)], timeout=120)
    results = sorted(line for node in nodes for line in node.stdout.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT (0, 2, 3)", "RESULT (1, 2, 3)"], [node.stderr[-2000:] for node in nodes]


CTRL_C_SCRIPT = textwrap.dedent("""
    import sys
    import hydraddp.distributed as idist
    from tests.distributed.workers import sleep_forever

    if __name__ == "__main__":
        try:
            idist.Parallel(backend="gloo", nproc_per_node=2).run(sleep_forever, sys.argv[1])
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(130)
""")


def test_ctrl_c_stops_every_worker(tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    done = interrupt_when([sys.executable, str(script), str(tmp_path)], cwd=REPO,
                          ready=lambda: len(list(tmp_path.glob("started-*"))) == 2)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "INTERRUPTED" in done.stdout
