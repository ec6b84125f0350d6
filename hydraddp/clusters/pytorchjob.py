"""Kubernetes through the Kubeflow training operator's PyTorchJob: the pods' variables, and the manifest.

- In a pod, the operator sets ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK`` and torchrun's ``PET_*``
  defaults (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_RDZV_ENDPOINT``/``PET_MASTER_ADDR``,
  ``PET_MAX_RESTARTS``). ``python -m hydraddp`` there reads them as torchrun would: as the defaults of ``launcher.*``
  (``pod_overrides``), so each pod runs its node's workers on torch's elastic agent. Under torchrun in the pod, torchrun
  reads them itself and hydraddp attaches.
- ``python -m hydraddp.kube [flags] [overrides]`` prints the PyTorchJob for the composed config (``manifest``), built
  from the operator's own models (the ``kubeflow-training`` SDK): never a hand-written copy of its schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# launcher.KEY <- the first of these variables that is set (torchrun's own PET_ names, then the operator's plain ones)
POD_VARIABLES = {
    "nnodes": ("PET_NNODES",),
    "nproc_per_node": ("PET_NPROC_PER_NODE",),
    "node_rank": ("PET_NODE_RANK", "RANK"),
    "max_restarts": ("PET_MAX_RESTARTS",),
}
TRACKING_URI_ENV = "HYDRADDP_TRACKING_URI"  # in the pods, from the Secret named by --tracking-secret


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((env[name] for name in names if env.get(name, "") != ""), None)


def pod_overrides(env: Mapping[str, str], given: list[str]) -> list[str]:
    """``launcher.*`` overrides from a PyTorchJob pod's variables (none outside one, or under torchrun, whose workers
    carry ``LOCAL_RANK``); a key the command line sets itself is left to it."""
    if "PET_NNODES" not in env or "LOCAL_RANK" in env:
        return []
    values: dict[str, str] = {}
    for key, names in POD_VARIABLES.items():
        value = _first(env, names)
        if value is not None:
            values[key] = value
    nnodes = values.get("nnodes", "")
    if ":" in nnodes:  # an elastic range "min:max": hydraddp's launcher starts the full size
        values["nnodes"] = nnodes.split(":")[-1]
    if not values.get("nproc_per_node", "1").isdigit():  # "auto"/"gpu"/"cpu": the config's value stands
        values.pop("nproc_per_node")
    endpoint = env.get("PET_RDZV_ENDPOINT") or (
        f"{_first(env, ('PET_MASTER_ADDR', 'MASTER_ADDR'))}:{_first(env, ('PET_MASTER_PORT', 'MASTER_PORT'))}"
        if _first(env, ("PET_MASTER_ADDR", "MASTER_ADDR")) else None)
    if endpoint:
        values["rdzv_endpoint"] = endpoint
    return [f"launcher.{key}={value}" for key, value in values.items()
            if not any(arg.startswith(f"launcher.{key}=") for arg in given)]


def manifest(cfg: Any, overrides: list[str], *, image: str, name: str, namespace: str | None = None,
             tracking_secret: str = "hydraddp-tracking", cpu: str | None = None, memory: str | None = None,
             gpus_per_node: int | None = None) -> dict[str, Any]:
    """The PyTorchJob that runs ``python -m hydraddp OVERRIDES`` as ``cfg`` says: ``launcher.nnodes`` replicas of
    ``launcher.nproc_per_node`` processes, an elastic policy when ``launcher.max_restarts`` > 0, and the tracking URI
    from a Secret (key ``uri``), never inline. Built from the operator's models, returned as plain data."""
    from kubeflow.training import models
    from kubeflow.training.api_client import ApiClient
    from kubernetes import client as k8s

    launcher = cfg.launcher
    if gpus_per_node is None and cfg.backend.name == "nccl" and launcher.nproc_per_node == "auto":
        raise ValueError("backend=nccl with launcher.nproc_per_node=auto: the pods' GPUs are not known here. Pass "
                         "--gpus-per-node N (each pod then runs one rank per GPU), or set launcher.nproc_per_node=N.")
    gpus = gpus_per_node if gpus_per_node is not None else (launcher.nproc_per_node if cfg.backend.name == "nccl"
                                                            else 0)
    limits = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    env = [k8s.V1EnvVar(name=TRACKING_URI_ENV, value_from=k8s.V1EnvVarSource(
        secret_key_ref=k8s.V1SecretKeySelector(name=tracking_secret, key="uri")))] if cfg.tracking.enabled else []
    args = [*overrides, *([f"tracking.uri=${{oc.env:{TRACKING_URI_ENV}}}"] if cfg.tracking.enabled else [])]
    container = k8s.V1Container(
        name="pytorch",  # the operator finds the training container by this name
        image=image, command=["python", "-m", "hydraddp"], args=args, env=env,
        resources=k8s.V1ResourceRequirements(limits=limits or None, requests=limits or None),
        ports=[k8s.V1ContainerPort(name="pytorchjob-port", container_port=23456)])
    template = k8s.V1PodTemplateSpec(spec=k8s.V1PodSpec(containers=[container]))
    elastic = launcher.max_restarts > 0
    if elastic:  # torch's elastic agent in every pod, restarting the group up to max_restarts times
        replicas = {"Worker": models.KubeflowOrgV1ReplicaSpec(replicas=launcher.nnodes, restart_policy="OnFailure",
                                                               template=template)}
    else:
        replicas = {"Master": models.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy="Never", template=template)}
        if launcher.nnodes > 1:
            replicas["Worker"] = models.KubeflowOrgV1ReplicaSpec(replicas=launcher.nnodes - 1, restart_policy="Never",
                                                                  template=template)
    job = models.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1", kind="PyTorchJob",
        metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
        spec=models.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(launcher.nproc_per_node),
            elastic_policy=models.KubeflowOrgV1ElasticPolicy(
                rdzv_backend="c10d", min_replicas=launcher.nnodes, max_replicas=launcher.nnodes,
                max_restarts=launcher.max_restarts) if elastic else None,
            pytorch_replica_specs=replicas,
            run_policy=models.KubeflowOrgV1RunPolicy(clean_pod_policy="None")))
    return ApiClient().sanitize_for_serialization(job)

