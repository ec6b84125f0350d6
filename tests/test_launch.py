"""hydraddp.launch.parallel_for: the Parallel one launch runs on, spawning its ranks or attached to a launcher's."""

import os

import pytest

from hydraddp.launch import parallel_for

# launcher.nnodes=2 without launcher.rdzv_endpoint: the README's multi-node hydra/launcher=slurm command.
TWO_NODES = {"backend": {"name": "gloo"},
             "launcher": {"nproc_per_node": 2, "nnodes": 2, "node_rank": 0, "rdzv_endpoint": None, "max_restarts": 0}}
# What a submitit task exports before it launches (clusters.submitit.attach): rank 3 of 4, on the job's second node.
SUBMITIT_TASK = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "c1",
                 "MASTER_PORT": "29500"}


def no_launcher(monkeypatch):
    for name in os.environ:
        if name in SUBMITIT_TASK or name.startswith(("SLURM_", "OMPI_", "PMI_", "HOROVOD_")):
            monkeypatch.delenv(name)


def test_an_attached_launch_takes_its_nodes_and_rendezvous_from_its_launcher(monkeypatch):
    no_launcher(monkeypatch)
    for name, value in SUBMITIT_TASK.items():
        monkeypatch.setenv(name, value)
    assert not parallel_for(TWO_NODES).spawns  # once refused on every task: no master_addr, no rdzv_endpoint


def test_a_launch_that_spawns_on_several_nodes_still_needs_their_address(monkeypatch):
    no_launcher(monkeypatch)
    with pytest.raises(ValueError, match="master_addr and master_port"):
        parallel_for(TWO_NODES)
    endpoint = {**TWO_NODES, "launcher": {**TWO_NODES["launcher"], "rdzv_endpoint": "node0:29400"}}
    assert parallel_for(endpoint).spawns
