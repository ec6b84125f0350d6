"""Kubernetes through the Kubeflow training operator: a PyTorchJob's pods, simulated on loopback with exactly the
variables the operator sets, and the manifest that hydraddp.kube prints, checked with the operator's own models."""

from __future__ import annotations

import json
import re
import sys

import pytest
import yaml

from hydraddp.clusters.pytorchjob import pod_overrides
from tests.helpers.spawn import REPO, job_dirs, rendezvous_port, run_process, run_together

QUICK = ["trainer.max_steps=12", "trainer.log_every=4", "trainer.eval_every=0", "tracking.enabled=false"]


def operator_env(replica: int, replicas: int, nproc: int, port: int) -> dict[str, str]:
    """What the training operator gives replica ``replica`` of a PyTorchJob (Master 0, Workers 1..), on loopback
    instead of the master's Service name."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(replicas * nproc),
            "RANK": str(replica), "PET_NNODES": str(replicas), "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(replica), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
            "PYTHONUNBUFFERED": "0"}


def test_the_pods_variables_are_the_launchers_defaults_and_the_command_line_wins():
    env = operator_env(1, 2, 4, 23456)
    assert pod_overrides(env, []) == ["launcher.nnodes=2", "launcher.nproc_per_node=4", "launcher.node_rank=1",
                                      "launcher.rdzv_endpoint=127.0.0.1:23456"]
    assert "launcher.nproc_per_node=4" not in pod_overrides(env, ["launcher.nproc_per_node=2"])
    elastic = {**env, "PET_NNODES": "1:3", "PET_RDZV_ENDPOINT": "job-worker-0:29400", "PET_MAX_RESTARTS": "2"}
    assert pod_overrides(elastic, []) == ["launcher.nnodes=3", "launcher.nproc_per_node=4", "launcher.node_rank=1",
                                          "launcher.max_restarts=2", "launcher.rdzv_endpoint=job-worker-0:29400"]
    assert pod_overrides({**env, "LOCAL_RANK": "0"}, []) == []  # under torchrun in the pod: torchrun read them
    assert pod_overrides({}, []) == []


@pytest.mark.slow
@pytest.mark.parametrize("through_torchrun", [False, True], ids=["python -m hydraddp", "torchrun -m hydraddp"])
def test_two_pods_of_a_pytorchjob_form_one_world_of_two_and_train(tmp_path, through_torchrun):
    port = rendezvous_port()
    command = ([sys.executable, "-m", "torch.distributed.run", "-m", "hydraddp"] if through_torchrun
               else [sys.executable, "-m", "hydraddp"])
    pods = []
    for replica in (0, 1):
        (tmp_path / f"pod{replica}").mkdir()
        pods.append(([*command, *QUICK], tmp_path / f"pod{replica}", operator_env(replica, 2, 1, port)))
    done = run_together(pods, timeout=240)
    assert [pod.returncode for pod in done] == [0, 0], [pod.stderr[-3000:] for pod in done]
    [job] = job_dirs(tmp_path / "pod0")
    result = json.loads((job / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 12
    logs = sorted((job / "logs").glob("rank*.log"))
    assert [log.name for log in logs] == ["rank0.log", "rank1.log"]
    losses = [re.findall(r"step 12 loss ([\d.]+)", log.read_text()) for log in logs]
    assert losses[0] == losses[1] != []  # one world: both ranks log the same averaged loss


def kube(*args: str):
    return run_process([sys.executable, "-m", "hydraddp.kube", *args], cwd=REPO, timeout=120)


def test_the_manifest_validates_with_the_operators_own_models_and_holds_no_secret():
    from kubeflow.training.api_client import ApiClient

    done = kube("--image", "registry.example/trainer:1", "--cpu", "8", "--memory", "32Gi",
                "launcher.nnodes=2", "launcher.nproc_per_node=4", "wrap=fsdp2",
                "tracking.uri=http://admin:hunter2@mlflow.internal:5000")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hunter2" not in done.stdout and "mlflow.internal" not in done.stdout
    data = yaml.safe_load(done.stdout)

    response = type("Response", (), {"data": json.dumps(data)})()  # what ApiClient.deserialize reads: the JSON body
    client = ApiClient()
    job = client.deserialize(response, "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(job) == data  # every key is one of the operator's own fields
    assert (job.api_version, job.kind, job.spec.nproc_per_node) == ("kubeflow.org/v1", "PyTorchJob", "4")
    specs = job.spec.pytorch_replica_specs
    assert sum(spec.replicas for spec in specs.values()) == 2 and sorted(specs) == ["Master", "Worker"]
    [container] = specs["Master"].template.spec.containers
    assert container.name == "pytorch" and container.image == "registry.example/trainer:1"
    assert container.command == ["python", "-m", "hydraddp"]
    assert container.args == ["launcher.nnodes=2", "launcher.nproc_per_node=4", "wrap=fsdp2",
                              "tracking.uri=${oc.env:HYDRADDP_TRACKING_URI}"]
    [uri] = container.env
    assert uri.value is None and uri.value_from.secret_key_ref.name == "hydraddp-tracking"
    assert container.resources.limits == {"cpu": "8", "memory": "32Gi"}
    assert job.spec.elastic_policy is None

    elastic = yaml.safe_load(kube("--image", "i:1", "launcher.nnodes=3", "launcher.max_restarts=2").stdout)
    assert elastic["spec"]["elasticPolicy"] == {"maxReplicas": 3, "maxRestarts": 2, "minReplicas": 3,
                                                "rdzvBackend": "c10d"}
    assert list(elastic["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert elastic["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3


def test_a_secret_looking_override_is_refused_rather_than_written_in_clear():
    done = kube("--image", "i:1", "+trainer.api_key=abc123")
    assert done.returncode == 2 and "abc123" not in done.stdout + done.stderr
    assert "Put the value in a Secret" in done.stderr


def test_nccl_with_nproc_per_node_auto_asks_for_the_pods_gpus_and_runs_one_rank_per_gpu_given():
    """auto is one rank per GPU the pod sees, and the manifest asks for the GPUs: here they are not known."""
    done = kube("--image", "i:1", "backend=nccl")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "backend=nccl with launcher.nproc_per_node=auto" in done.stderr and "--gpus-per-node N" in done.stderr
    given = yaml.safe_load(kube("--image", "i:1", "--gpus-per-node", "8", "backend=nccl").stdout)
    assert given["spec"]["nprocPerNode"] == "auto"  # torchrun's own auto in the pod: its 8 GPUs
    container = given["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
