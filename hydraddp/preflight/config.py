"""Whole-combination validation of a composed config, in the main process, before any worker starts.

The rules are the core's (``hydraddp.parallel.combinations``); this module maps config keys onto them and
adds the few that only exist in config (scaler settings, multi-node rendezvous).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from hydraddp.parallel.combinations import Combination, Problem, check_compatibility
from hydraddp.distributed.env import detect_launch_env
from hydraddp.parallel.machine import combination, cuda_device_count, nproc_per_node_of
from hydraddp.tracking import names
from hydraddp.handoff.preemption import signal_numbers

INIT_DEVICES = ("auto", "meta", "cpu")  # model.init_device (hydraddp.build.instantiate_model)

# Where each rule's keys live in the config, so messages name what the user types.
CONFIG_NAMES = {
    "backend": "backend",
    "wrap": "wrap",
    "precision": "precision",
    "offload": "offload",
    "sync_bn": "model.sync_bn",
    "compile": "trainer.compile",
    "world_size": "launcher.nproc_per_node",
    "nproc_per_node": "launcher.nproc_per_node",
    "batch_size": "data.batch_size",
    "tp": "mesh.tp",
}


SCALER_KEYS = ("init_scale", "growth_interval")


def resolve_backend(name: str) -> str:
    """``backend=auto``: nccl with CUDA, else gloo."""
    if name != "auto":
        return name
    return "nccl" if cuda_device_count() > 0 else "gloo"


def complete(cfg: DictConfig) -> None:
    """Decide ``backend=auto`` and then ``launcher.nproc_per_node=auto`` in ``cfg``, for this machine: what the
    checks, the plan and the launch all read from then on."""
    cfg.backend.name = resolve_backend(cfg.backend.name)
    cfg.launcher.nproc_per_node = nproc_per_node_of(cfg.launcher.nproc_per_node, cfg.backend.name)


def nproc_problems(cfg: DictConfig) -> list[Problem]:
    """``launcher.nproc_per_node`` that is not a count once ``complete`` decided ``auto``: refused before anything
    computes a world size with it."""
    nproc = cfg.launcher.nproc_per_node
    if isinstance(nproc, int) and not isinstance(nproc, bool):
        return []
    return [Problem(("launcher.nproc_per_node",), f"launcher.nproc_per_node={nproc} is neither a number of "
                    "processes nor auto.", "Set launcher.nproc_per_node=N, or auto (one per GPU under nccl, else 2).")]


def world_size(cfg: DictConfig) -> int:
    """The processes of the launch: what torchrun/SLURM started when attached, else the launcher group's."""
    launch = detect_launch_env()
    if launch is not None:
        return launch.world_size
    if cfg.backend.name == "none":
        return cfg.launcher.nproc_per_node
    return cfg.launcher.nproc_per_node * cfg.launcher.nnodes


def nproc_per_node(cfg: DictConfig) -> int:
    launch = detect_launch_env()
    return launch.local_world_size if launch is not None else cfg.launcher.nproc_per_node


def data_parallel_size(cfg: DictConfig) -> int:
    """The ranks that read different batches: the world over ``mesh.tp`` (a TP group reads one batch)."""
    tp = cfg.mesh.tp if cfg.wrap.name == "fsdp2" and cfg.mesh.tp > 0 else 1
    return max(world_size(cfg) // tp, 1)


def combination_of(cfg: DictConfig) -> Combination:
    """The core's view of ``cfg``, with this machine's facts, for its rules and for ``resolve_wrap``."""
    names = dict(CONFIG_NAMES)
    if cfg.launcher.nnodes > 1:
        names["world_size"] = "launcher.nproc_per_node x launcher.nnodes"
    return combination(
        backend=resolve_backend(cfg.backend.name),
        wrap=cfg.wrap.name,
        precision=cfg.precision.name,
        offload=cfg.offload.name,
        sync_bn=bool(cfg.model.get("sync_bn", False)),
        compile=cfg.trainer.compile,
        world_size=world_size(cfg),
        nproc_per_node=nproc_per_node(cfg),
        attached=detect_launch_env() is not None,
        global_batch_size=cfg.data.batch_size,
        data_parallel_size=data_parallel_size(cfg),
        names=names,
    )


def problems(cfg: DictConfig, combo: Combination | None = None, *, cluster_rendezvous: bool = False) -> list[Problem]:
    """Every problem of the composed ``cfg`` (whose core view is ``combo``, when known), each naming its config keys
    and the fix. ``cfg``'s ``auto`` values are decided first (``complete``). ``cluster_rendezvous``: see
    ``launcher_problems``."""
    complete(cfg)
    if nproc_problems(cfg):
        return nproc_problems(cfg)
    found = check_compatibility(combo or combination_of(cfg)) + range_problems(cfg)
    for rule in SETTING_RULES:
        found += rule(cfg)
    found += mesh_problems(cfg, combo or combination_of(cfg)) + tp_plan_problems(cfg)
    return found + launcher_problems(cfg, cluster_rendezvous=cluster_rendezvous)


def _preempt_signal_problems(cfg: DictConfig) -> list[Problem]:
    try:
        signal_numbers(list(cfg.checkpoint.preempt_signals))
    except ValueError as exc:
        return [Problem(("checkpoint.preempt_signals",), f"checkpoint.preempt_signals: {exc}.",
                        "Name signals as Python's signal module does (SIGTERM, SIGUSR2), or set [] for none.")]
    return []


def _run_name_problems(cfg: DictConfig) -> list[Problem]:
    found = []
    for key in ("run_name", "sweep_run_name"):
        unnamed = names.run_name_problem(cfg.tracking[key], f"tracking.{key}")
        if unnamed:
            found.append(Problem((f"tracking.{key}",), f"{unnamed}.",
                                 f"Use only {', '.join('{' + f + '}' for f in names.RUN_NAME_FIELDS)} (and any "
                                 "text), e.g. tracking.run_name='{experiment}-{wrap}-{precision}-w{world}-{id}'."))
    return found


def _init_device_problems(cfg: DictConfig) -> list[Problem]:
    init_device = cfg.model.get("init_device", "auto")
    if init_device in INIT_DEVICES:
        return []
    return [Problem(("model.init_device",), f"model.init_device={init_device} is not one of "
                    f"{', '.join(INIT_DEVICES)}.",
                    "Set model.init_device=auto (meta under fsdp/fsdp2), meta or cpu (the whole model on "
                    "every rank).")]


def _scaler_problems(cfg: DictConfig) -> list[Problem]:
    scaler_keys = [f"precision.{k}={cfg.precision[k]}" for k in SCALER_KEYS if cfg.precision[k] is not None]
    if not scaler_keys or cfg.precision.name == "fp16":
        return []
    return [Problem(
        ("precision", *(k.split("=")[0] for k in scaler_keys)),
        f"precision={cfg.precision.name} uses no grad scaler, but {', '.join(scaler_keys)} is set.",
        "Drop the grad scaler settings, or use precision=fp16 (the only mode that scales gradients).",
    )]


def _accumulation_problems(cfg: DictConfig) -> list[Problem]:
    """Gradient accumulation splits each rank's batch into equal micro-batches."""
    accumulate, world = cfg.trainer.accumulate_grad_batches, data_parallel_size(cfg)
    per_rank = cfg.data.batch_size // world if world else 0
    if not (accumulate > 1 and per_rank and per_rank % accumulate):
        return []
    divisors = [d for d in range(2, per_rank + 1) if per_rank % d == 0][:6]
    return [Problem(
        ("trainer.accumulate_grad_batches", "data.batch_size"),
        f"trainer.accumulate_grad_batches={accumulate} does not divide the per-rank batch of {per_rank} "
        f"(data.batch_size={cfg.data.batch_size} over {world} ranks) into equal micro-batches.",
        f"Set trainer.accumulate_grad_batches to a divisor of {per_rank} ({', '.join(map(str, divisors))}, ...), "
        "or change data.batch_size.",
    )]


def _no_decay_problems(cfg: DictConfig) -> list[Problem]:
    if not (cfg.optim.no_decay_norm_and_bias and cfg.wrap.name == "fsdp"
            and cfg.wrap.kwargs.get("use_orig_params") is False):
        return []
    return [Problem(
        ("optim.no_decay_norm_and_bias", "wrap.kwargs.use_orig_params"),
        "optim.no_decay_norm_and_bias=true needs FSDP1's original parameters, but "
        "wrap.kwargs.use_orig_params=false flattens them into one parameter per unit: biases and norm weights "
        "could not be told apart.",
        "Drop wrap.kwargs.use_orig_params (hydraddp then sets it to true), "
        "or set optim.no_decay_norm_and_bias=false.",
    )]


# The settings only config has, each checked on its own, in the order their problems are listed.
SETTING_RULES = (_preempt_signal_problems, _run_name_problems, _init_device_problems, _scaler_problems,
                 _accumulation_problems, _no_decay_problems)


def launcher_problems(cfg: DictConfig, *, cluster_rendezvous: bool = False) -> list[Problem]:
    """The launcher group's processes, nodes and rendezvous; none when attached (torchrun/SLURM already decided
    processes and nodes, and the launcher group is unused). ``cluster_rendezvous``: the launch is checked before a
    cluster starts it (a submitit job, on the login node): its tasks will attach to the allocation's own rendezvous
    (``clusters.submitit.attach``: the job's first node), so several nodes need no ``launcher.rdzv_endpoint``."""
    if detect_launch_env() is not None:
        return []
    launcher = cfg.launcher
    found = []
    if launcher.nproc_per_node < 1 or launcher.nnodes < 1:
        found.append(Problem(("launcher.nproc_per_node", "launcher.nnodes"),
                             f"launcher.nproc_per_node={launcher.nproc_per_node} and launcher.nnodes="
                             f"{launcher.nnodes} must both be at least 1.", "Set them to 1 or more."))
    if launcher.nnodes > 1 and not launcher.rdzv_endpoint and not cluster_rendezvous:
        found.append(Problem(("launcher.nnodes", "launcher.rdzv_endpoint"),
                             f"launcher.nnodes={launcher.nnodes} needs a rendezvous address every node can reach.",
                             "Set launcher.rdzv_endpoint=HOST:PORT, the same on every node."))
    if not 0 <= launcher.node_rank < launcher.nnodes:
        found.append(Problem(("launcher.node_rank",), f"launcher.node_rank={launcher.node_rank} is not in "
                             f"[0, launcher.nnodes={launcher.nnodes}).", "Number the nodes 0 .. nnodes-1."))
    return found


MESH_KEYS = ("mesh.dp_replicate", "mesh.dp_shard", "mesh.tp")


def mesh_problems(cfg: DictConfig, combo: Combination) -> list[Problem]:
    """The mesh's degrees against the world, the wrap, the node and the batch."""
    from hydraddp.parallel.combinations import resolve_wrap
    from hydraddp.parallel.mesh import MeshShape

    world = combo.world_size
    try:
        shape = MeshShape.of(cfg.mesh).resolved(world)
    except ValueError as exc:
        return [Problem(MESH_KEYS, f"{exc}.",
                        f"Make mesh.dp_replicate x mesh.dp_shard x mesh.tp the world size ({world}), or leave "
                        "mesh.dp_shard=-1 (the ranks left).")]
    if not shape.multi_dimensional:
        return []
    wrap = resolve_wrap(combo)
    if shape.tp > 1 and wrap == "fsdp2":
        return _tp_problems(cfg, shape, combo)
    if wrap == "ddp" and shape.dp_replicate == world and shape.tp == 1:
        return []  # DDP is this mesh: every rank a replica
    if wrap != "fsdp2":
        keys = ("mesh.tp", "wrap") if shape.tp > 1 else ("mesh.dp_replicate", "wrap")
        return [Problem(keys,
                        f"mesh {shape.describe()} needs wrap=fsdp2: HSDP and tensor parallel are built on FSDP2's "
                        f"fully_shard and a device mesh, and wrap={wrap} has one data-parallel dimension"
                        f"{' (DDP: mesh.dp_replicate equal to the world size)' if wrap == 'ddp' else ''}.",
                        "Use wrap=fsdp2, or leave mesh.* at its defaults.")]
    return []


def _tp_problems(cfg: DictConfig, shape: Any, combo: Combination) -> list[Problem]:
    """Tensor parallel's own limits: within one node, and a plan given as a mapping."""
    found = []
    nproc = combo.nproc_per_node or combo.world_size
    if shape.tp > nproc:
        found.append(Problem(("mesh.tp", "launcher.nproc_per_node"),
                             f"mesh.tp={shape.tp} is more than the {nproc} processes of a node: a TP group "
                             "exchanges activations at every layer, which only a node's own links are fast enough for.",
                             f"Set mesh.tp to at most {nproc} (a divisor of it), and shard or replicate across nodes "
                             "with mesh.dp_shard and mesh.dp_replicate."))
    plan = cfg.wrap.get("tp_plan")
    if plan is not None and not (OmegaConf.is_dict(plan) and all(isinstance(v, str) for v in plan.values())):
        found.append(Problem(("wrap.tp_plan",), f"wrap.tp_plan={plan!r} is not a mapping of module patterns to style "
                             "names.", "Write it as wrap.tp_plan='{layers.*.q: colwise, layers.*.o: rowwise}'."))
    return found


def tp_plan_problems(cfg: DictConfig) -> list[Problem]:
    """``wrap.tp_plan`` given where no tensor parallel runs (it would be ignored)."""
    if cfg.wrap.get("tp_plan") and not (cfg.wrap.name == "fsdp2" and cfg.mesh.tp > 1):
        return [Problem(("wrap.tp_plan", "mesh.tp"),
                        f"wrap.tp_plan is set, but tensor parallel does not run (wrap={cfg.wrap.name}, "
                        f"mesh.tp={cfg.mesh.tp}): the plan would be ignored.",
                        "Set mesh.tp > 1 under wrap=fsdp2, or drop wrap.tp_plan.")]
    return []


# Every numeric key with the smallest value that means something (None: the key may be null).
MINIMUMS = {
    "data.batch_size": 1, "data.eval_batch_size": 1, "data.num_workers": 0, "data.seq_len": 1,
    "trainer.max_steps": 1, "trainer.log_every": 1, "trainer.accumulate_grad_batches": 1, "trainer.eval_every": 0, "trainer.stop_at_step": 1,
    "checkpoint.every_n_steps": 0, "checkpoint.keep_last": 0, "checkpoint.preempt_check_every": 1, "launcher.max_restarts": 0,
    "precision.growth_interval": 1, "tracking.per_rank_table_above": 1, "tracking.model.max_copy_mb": 0,
}
POSITIVE = ("trainer.grad_clip", "trainer.peak_tflops", "tracking.flush_timeout_s", "precision.init_scale",
            "tracking.system_metrics.interval_s", "launcher.timeout")
NULLABLE = ("trainer.grad_clip", "trainer.peak_tflops")  # null: off (clipping), the table (the peak)


def range_problems(cfg: DictConfig) -> list[Problem]:
    """Batch sizes, steps, intervals and limits out of range, each with its key and the smallest valid value."""
    found = []
    for key, least in MINIMUMS.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and value < least:
            meaning = "1 or more" if least == 1 else "0 or more"
            found.append(Problem((key,), f"{key}={value} is out of range.", f"Set {key} to {meaning}."))
    for key in POSITIVE:
        value = OmegaConf.select(cfg, key)
        if value is not None and value <= 0:
            found.append(Problem((key,), f"{key}={value} must be greater than 0.",
                                 f"Set {key} to a positive number{' or null' if key in NULLABLE else ''}."))
    return found
