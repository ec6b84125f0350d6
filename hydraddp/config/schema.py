"""Structured-config schemas: the typed shape of every hydraddp-owned group.

Registered in Hydra's ConfigStore as ``hydraddp_schema`` and named first in conf/config.yaml's defaults,
so a misspelled key or a value of the wrong type fails at compose time, before anything runs. ``model``,
``optim`` and ``data.dataset`` are ``_target_`` nodes whose keys belong to the classes they build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class BackendConfig:
    name: str = "auto"


@dataclass
class WrapConfig:
    name: str = "auto"
    kwargs: dict[str, Any] = field(default_factory=dict)  # forwarded to the wrapper
    # With mesh.tp > 1: {module pattern: style} instead of the model's own plan (distributed.tp.resolve_tp_plan).
    tp_plan: Any = None


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    # Grad scaler settings: fp16 only (the other precisions scale nothing).
    init_scale: Optional[float] = None
    growth_interval: Optional[int] = None  # steps without an overflow before the scale doubles


@dataclass
class OffloadConfig:
    name: str = "none"


@dataclass
class LauncherConfig:
    nproc_per_node: Any = "auto"  # an integer, or auto: one per GPU with nccl (parallel.machine.auto_nproc_per_node)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    max_restarts: int = 0
    timeout: float = 600.0  # seconds the ranks of an attached launch wait for each other to form the group


@dataclass
class DataConfig:
    dataset: Any = MISSING
    batch_size: int = 64
    eval_batch_size: int = 256  # global, for evaluation
    num_workers: int = 0  # DataLoader worker processes per rank
    seq_len: Optional[int] = None  # tokens per sample, for text data (models with positions read it too)


@dataclass
class OptimConfig:
    optimizer: Any = MISSING
    scheduler: Any = None
    no_decay_norm_and_bias: bool = False  # biases and norm weights in a group with weight_decay=0


@dataclass
class TrainerConfig:
    max_steps: int = 150
    log_every: int = 10
    eval_every: int = 50
    seed: int = 0
    grad_clip: Optional[float] = 1.0
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step (the global batch stays data.batch_size)
    activation_checkpointing: bool = False  # recompute each block's activations in backward (the model's blocks)
    compile: bool = False  # torch.compile: per block before fully_shard (fsdp2), the whole model (none, ddp)
    progress: bool = True
    stop_at_step: Optional[int] = None  # end this launch early, as a preemption would (a checkpoint is written)
    peak_tflops: Optional[float] = None  # the device's peak in the compute dtype, for MFU (null: the known devices')


@dataclass
class SystemMetricsConfig:
    """MLflow's own system-metrics monitor, sampled on every node by its tracker (never in a training rank)."""

    enabled: bool = True
    interval_s: float = 10.0  # seconds between samples


@dataclass
class LoggedModelConfig:
    """The trained model as an MLflow LoggedModel of the run (``mlflow.pytorch``)."""

    enabled: bool = True  # at the end of a launch that finished
    every_checkpoint: bool = False  # also at each periodic checkpoint
    max_copy_mb: float = 1024.0  # above this, the LoggedModel refers to the DCP checkpoint instead of a copy


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: Optional[str] = None
    experiment: str = "hydraddp"
    run_id: Optional[str] = None
    tags: dict[str, str] = field(default_factory=dict)  # extra tags on the run (+tracking.tags.team=vision)
    flush_timeout_s: float = 60.0  # how long the end of a launch waits for an absent server
    # The run's name: {experiment} {wrap} {precision} {world} {backend} {offload} {model} {id}; empty fields drop out
    run_name: str = "{experiment}-{wrap}-{precision}-w{world}-{id}"
    # A sweep's job: named by what the sweep varies ({swept}: ddp-bf16, lr=0.001), else by run_name
    sweep_run_name: str = "{swept}"
    system_metrics: SystemMetricsConfig = field(default_factory=SystemMetricsConfig)
    model: LoggedModelConfig = field(default_factory=LoggedModelConfig)
    datasets: bool = True  # the training and evaluation sets as run inputs (name, digest, source, schema)
    per_rank_table_above: int = 64  # more ranks than this: per-rank values go to a table artifact, not a key each


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0
    dir: Optional[str] = None
    keep_last: int = 2
    resume: Optional[str] = None
    save_last: bool = False
    async_save: bool = True  # periodic checkpoints are written in the background while training goes on
    # Signals that stop the job after a checkpoint every rank writes at the same step (exit 3; submitit requeues)
    preempt_signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR2"])
    # The ranks agree on a signal every this many steps (a host all-reduce): they stop at most this + 1 steps after it
    preempt_check_every: int = 10


@dataclass
class MeshConfig:
    """The device mesh (hydraddp/parallel/mesh.py): the product of the degrees is the world size."""

    dp_replicate: int = 1  # data-parallel replicas (HSDP across nodes: each holds the model sharded dp_shard ways)
    dp_shard: int = -1  # data-parallel shards; -1: the ranks left
    tp: int = 1  # tensor-parallel ranks (within a node)
    pp: int = 1  # pipeline stages' places: the model cut along its blocks (hydraddp/parallel/pipeline.py)
    # torch's schedule: 1F1B, GPipe; Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (pp_stages_per_rank each);
    # ZBVZeroBubble, DualPipeV (two stages per rank, in a V)
    pp_schedule: str = "1F1B"
    pp_microbatches: Optional[int] = None  # microbatches of each step; null: one per stage
    pp_stages_per_rank: int = 1  # the looped schedules' stages on each rank (2 or more)
    pp_split: Optional[List[int]] = None  # the first block of each stage after the first; null: balanced by size


@dataclass
class PlanConfig:
    """``python -m hydraddp.plan`` and the plan every launch records (hydraddp/plan/)."""

    record: bool = True  # the launch is planned beside the workers: plan/* params, plan.json, plan/error
    measure: bool = True  # torch's MemTracker over the second step: the measured peak the plan is checked against
    budget_gb: Optional[float] = None  # per-rank memory: which wraps and settings fit, and the one to use


@dataclass
class Config:
    backend: BackendConfig = field(default_factory=BackendConfig)
    wrap: WrapConfig = field(default_factory=WrapConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    model: Any = MISSING
    task: Any = MISSING  # a _target_ node: what a batch costs and what evaluation reports (hydraddp/train/tasks.py)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)


def tasks_per_node(nproc_per_node: Any, gpus_per_node: Any) -> int:
    """A Slurm job's tasks per node for ``launcher.nproc_per_node``: ``auto`` is one per GPU the job asks for
    (``hydra.launcher.gpus_per_node``), and without GPUs the CPU default (``machine.auto_nproc_per_node``'s rule, on
    the nodes the job gets rather than the machine that submits it)."""
    from hydraddp.parallel.machine import CPU_NPROC_PER_NODE

    if nproc_per_node != "auto":
        return nproc_per_node
    return int(gpus_per_node) if gpus_per_node else CPU_NPROC_PER_NODE


def register() -> None:
    ConfigStore.instance().store(name="hydraddp_schema", node=Config)
    OmegaConf.register_new_resolver("hydraddp.tasks_per_node", tasks_per_node, replace=True)
