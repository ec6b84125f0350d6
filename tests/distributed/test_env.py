"""Reading launcher environments: torchrun, SLURM, Open MPI, MPICH/Intel MPI, horovodrun."""

import pytest

from hydraddp.distributed.env import LaunchEnv, detect_launch_env, expand_first_host, free_port


def test_nothing_set_means_no_launcher():
    assert detect_launch_env({"PATH": "/usr/bin"}) is None


def test_torchrun():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert detect_launch_env(env) == LaunchEnv("torchrun", 3, 1, 4, 2, 1, 2, "node0", 29500)


def test_slurm_with_nodelist_and_ignite_port_rule():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    found = detect_launch_env(env)
    assert found == LaunchEnv("slurm", 5, 1, 8, 4, 1, 2, "gpu07", 15000 + 3456)


def test_torchrun_inside_slurm_wins():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert detect_launch_env(env).source == "torchrun"


@pytest.mark.parametrize(
    "env, source",
    [
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "mpi"),
        ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, "mpi"),
        ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2",
          "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}, "horovod"),
    ],
)
def test_mpi_style_launchers(env, source):
    found = detect_launch_env(env)
    assert (found.source, found.rank, found.local_rank, found.world_size, found.local_world_size) == (source, 2, 0, 4, 2)
    assert (found.node_rank, found.nnodes) == (1, 2)


@pytest.mark.parametrize(
    "nodelist, first",
    [("node1", "node1"), ("a[3-5,9],b1", "a3"), ("x-[001-004]-ib", "x-001-ib"), ("h1,h2", "h1")],
)
def test_expand_first_host(nodelist, first):
    assert expand_first_host(nodelist) == first


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
