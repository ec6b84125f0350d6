"""Reading launcher environments: torchrun, SLURM, Open MPI, MPICH/Intel MPI, horovodrun."""

import pytest

from hydraddp.distributed.env import (LaunchEnv, detect_launch_env, expand_first_host, free_port,
                                      slurm_allocation_outside_step)


def test_nothing_set_means_no_launcher():
    assert detect_launch_env({"PATH": "/usr/bin"}) is None


def test_torchrun():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert detect_launch_env(env) == LaunchEnv("torchrun", 3, 1, 4, 2, 1, 2, "node0", 29500)


def test_slurm_with_nodelist_and_ignite_port_rule():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    found = detect_launch_env(env)
    assert found == LaunchEnv("slurm", 5, 1, 8, 4, 1, 2, "gpu07", 15000 + 3456)


def test_torchrun_inside_slurm_wins():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "LOCAL_RANK": "1",
           "WORLD_SIZE": "2"}
    assert detect_launch_env(env).source == "torchrun"


@pytest.mark.parametrize("step", [None, "4294967293", "4294967294", "4294967295"],
                         ids=["salloc shell", "interactive step", "batch script", "extern step"])
def test_a_slurm_allocation_outside_an_srun_step_is_not_attached_to(step):
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", **({"SLURM_STEP_ID": step} if step else {})}
    assert detect_launch_env(env) is None
    assert slurm_allocation_outside_step(env) == "77"


def test_an_srun_step_is_attached_to_with_its_own_task_count():
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "8",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1"}
    found = detect_launch_env(env)
    assert (found.source, found.rank, found.world_size) == ("slurm", 1, 2)
    assert slurm_allocation_outside_step(env) is None


def test_cuda_device_count_reads_the_driver_list_and_never_touches_cuda(tmp_path, monkeypatch):
    import importlib.metadata

    import torch

    from hydraddp.parallel import machine

    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (gpus / bus).mkdir(parents=True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cu130")  # as on a GPU build
    for touch in ("is_available", "device_count", "init"):
        monkeypatch.setattr(torch.cuda, touch, lambda *a: pytest.fail("the CUDA driver was touched"))
    assert machine.cuda_device_count({}, gpus) == 3
    assert machine.cuda_device_count({"CUDA_VISIBLE_DEVICES": "2,0"}, gpus) == 2
    assert machine.cuda_device_count({"CUDA_VISIBLE_DEVICES": ""}, gpus) == 0
    assert machine.cuda_device_count({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, gpus) == 1
    assert machine.cuda_device_count({}, tmp_path / "no-driver", tmp_path / "no-driver") == 0


def test_gpus_under_rocm_are_counted_from_the_amd_drivers_topology(tmp_path, monkeypatch):
    import importlib.metadata

    import torch

    from hydraddp.parallel import machine

    nodes = tmp_path / "nodes"
    for node, simds in enumerate([0, 304, 304, 0, 304]):  # two CPU nodes, three MI300-like GPUs
        (nodes / str(node)).mkdir(parents=True)
        (nodes / str(node) / "properties").write_text(f"cpu_cores_count {0 if simds else 64}\nsimd_count {simds}\n")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+rocm6.4")
    for touch in ("is_available", "device_count", "init"):
        monkeypatch.setattr(torch.cuda, touch, lambda *a: pytest.fail("the GPU driver was touched"))
    no_nvidia = tmp_path / "no-nvidia"
    assert machine.cuda_device_count({}, no_nvidia, nodes) == 3
    assert machine.cuda_device_count({"HIP_VISIBLE_DEVICES": "0,2"}, no_nvidia, nodes) == 2
    assert machine.cuda_device_count({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0,1"}, no_nvidia, nodes) == 1
    assert machine.cuda_device_count({"CUDA_VISIBLE_DEVICES": ""}, no_nvidia, nodes) == 0


def test_a_visible_gpu_means_workers_are_spawned_not_forked(monkeypatch):
    from hydraddp.distributed import launcher
    from hydraddp.parallel import machine

    assert launcher.worker_start_method("gloo") == "fork"  # this CPU machine
    # Node 0 of several hosts the agents' store, which the other nodes' workers connect to at any time: no fork there.
    assert launcher.worker_start_method("gloo", nnodes=2, node_rank=0) == "spawn"
    assert launcher.worker_start_method("gloo", nnodes=2, node_rank=1) == "fork"
    monkeypatch.setattr(machine, "cuda_device_count", lambda *a: 1)
    assert launcher.worker_start_method("gloo") == "spawn"


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
        s.bind(("127.0.0.1", port))  # raises OSError (the test fails) when the port is taken
        assert s.getsockname() == ("127.0.0.1", port) and 0 < port < 65536


def test_a_rank_uses_its_local_rank_or_the_one_gpu_its_task_sees():
    from hydraddp.parallel.machine import rank_device_index

    assert [rank_device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [rank_device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]  # srun --gpus-per-task=1: each sees its own
    with pytest.raises(RuntimeError, match=r"local rank 3 has no GPU of its own: this process sees 2 GPU\(s\)"):
        rank_device_index(3, 2)


def test_nccl_groups_get_a_gloo_side_for_cpu_tensors_and_keep_ignites_backend_name():
    from hydraddp.distributed.comp_models.native import backend_name, with_cpu_side

    assert with_cpu_side("nccl") == "cuda:nccl,cpu:gloo"  # offloaded FSDP2 clips CPU DTensors on this group
    assert with_cpu_side("gloo") == "gloo"
    assert backend_name(with_cpu_side("nccl")) == "nccl" and backend_name("gloo") == "gloo"


def test_the_join_timeout_is_the_argument_else_launcher_timeout_else_torchs_default(monkeypatch):
    import datetime

    import torch.distributed as dist

    from hydraddp.distributed.join import join_timeout
    from hydraddp.distributed.env import JOIN_TIMEOUT_ENV

    monkeypatch.delenv(JOIN_TIMEOUT_ENV, raising=False)
    assert join_timeout(None) == dist.default_pg_timeout
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, "20.0")  # what the CLI sets from launcher.timeout
    assert join_timeout(None) == datetime.timedelta(seconds=20)
    assert join_timeout(datetime.timedelta(seconds=5)) == datetime.timedelta(seconds=5)


def test_a_group_that_did_not_form_names_the_rank_to_look_at():
    from hydraddp.distributed.join import GroupNotFormedError

    assert str(GroupNotFormedError(20, (0,))) == "rank 0 did not join within 20 s: see rank 0's log"
    refused = GroupNotFormedError(20, refused_by=0, reason="checkpoint.resume: unreadable meta.json")
    assert str(refused) == "rank 0 refused to start: checkpoint.resume: unreadable meta.json: see rank 0's log"


def test_a_rank_whose_rank_0_never_listens_names_the_launchs_timeout_not_what_was_left_of_it():
    """Under load the knock on rank 0's port began a moment after the deadline was set: the error once said
    "within launcher.timeout=19.9991 s" for 20."""
    import datetime

    from hydraddp.distributed.join import GroupNotFormedError, join

    launch = LaunchEnv(source="slurm", rank=1, local_rank=0, world_size=2, local_world_size=1, node_rank=1, nnodes=2)
    with pytest.raises(GroupNotFormedError) as raised:
        join(launch, "127.0.0.1", free_port(), datetime.timedelta(seconds=0.3))  # nothing listens there
    assert raised.value.missing == (0,) and raised.value.timeout_s == 0.3
    assert str(raised.value) == "rank 0 did not join within 0.3 s: see rank 0's log"
