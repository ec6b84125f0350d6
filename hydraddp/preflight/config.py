"""The rules of a config's settings, in the main process, before any worker starts: each judges the one typed
``Settings`` (``preflight.settings``) and returns its problems, each naming its config keys and the fix.

The rules of the combination are the core's (``hydraddp.parallel.combinations``); the rest exist only in config
(scaler settings, the mesh against the wrap, ranges, multi-node rendezvous).
"""

from __future__ import annotations

from omegaconf import DictConfig

from hydraddp.handoff.preemption import signal_numbers
from hydraddp.parallel.combinations import Problem, check_compatibility
from hydraddp.parallel.mesh import MeshShape
from hydraddp.preflight.settings import Settings, complete, nproc_problems
from hydraddp.tracking import names

INIT_DEVICES = ("auto", "meta", "cpu")  # model.init_device (hydraddp.build.instantiate_model)
SCALER_KEYS = ("init_scale", "growth_interval")


def problems(cfg: DictConfig, *, cluster_rendezvous: bool = False) -> list[Problem]:
    """Every problem of the composed ``cfg``, each naming its config keys and the fix: ``cfg`` is completed
    (``complete``: its ``auto`` values decided, in place), read once into its ``Settings``, and judged
    (``judge``)."""
    complete(cfg)
    if nproc_problems(cfg):
        return nproc_problems(cfg)
    return judge(Settings.of(cfg), cluster_rendezvous=cluster_rendezvous)


def judge(settings: Settings, *, cluster_rendezvous: bool = False) -> list[Problem]:
    """Every rule of the settings, in the order their problems are listed. ``cluster_rendezvous``: see
    ``launcher_problems``."""
    found = check_compatibility(settings.combination) + range_problems(settings)
    for rule in SETTING_RULES:
        found += rule(settings)
    found += mesh_problems(settings) + tp_plan_problems(settings)
    return found + launcher_problems(settings, cluster_rendezvous=cluster_rendezvous)


def _preempt_signal_problems(settings: Settings) -> list[Problem]:
    try:
        signal_numbers(settings.config.checkpoint.preempt_signals)
    except ValueError as exc:
        return [Problem(("checkpoint.preempt_signals",), f"checkpoint.preempt_signals: {exc}.",
                        "Name signals as Python's signal module does (SIGTERM, SIGUSR2), or set [] for none.")]
    return []


def _run_name_problems(settings: Settings) -> list[Problem]:
    found = []
    for key in ("run_name", "sweep_run_name"):
        unnamed = names.run_name_problem(getattr(settings.config.tracking, key), f"tracking.{key}")
        if unnamed:
            found.append(Problem((f"tracking.{key}",), f"{unnamed}.",
                                 f"Use only {', '.join('{' + f + '}' for f in names.RUN_NAME_FIELDS)} (and any "
                                 "text), e.g. tracking.run_name='{experiment}-{wrap}-{precision}-w{world}-{id}'."))
    return found


def _init_device_problems(settings: Settings) -> list[Problem]:
    init_device = settings.config.model.get("init_device", "auto")
    if init_device in INIT_DEVICES:
        return []
    return [Problem(("model.init_device",), f"model.init_device={init_device} is not one of "
                    f"{', '.join(INIT_DEVICES)}.",
                    "Set model.init_device=auto (meta under fsdp/fsdp2), meta or cpu (the whole model on "
                    "every rank).")]


def _scaler_problems(settings: Settings) -> list[Problem]:
    precision = settings.config.precision
    scaler_keys = [f"precision.{k}={getattr(precision, k)}" for k in SCALER_KEYS if getattr(precision, k) is not None]
    if not scaler_keys or precision.name == "fp16":
        return []
    return [Problem(
        ("precision", *(k.split("=")[0] for k in scaler_keys)),
        f"precision={precision.name} uses no grad scaler, but {', '.join(scaler_keys)} is set.",
        "Drop the grad scaler settings, or use precision=fp16 (the only mode that scales gradients).",
    )]


def _accumulation_problems(settings: Settings) -> list[Problem]:
    """Gradient accumulation splits each rank's batch into equal micro-batches."""
    batch_size = settings.config.data.batch_size
    accumulate, world = settings.config.trainer.accumulate_grad_batches, settings.combination.data_parallel_size
    per_rank = batch_size // world if world else 0
    if not (accumulate > 1 and per_rank and per_rank % accumulate):
        return []
    divisors = [d for d in range(2, per_rank + 1) if per_rank % d == 0][:6]
    return [Problem(
        ("trainer.accumulate_grad_batches", "data.batch_size"),
        f"trainer.accumulate_grad_batches={accumulate} does not divide the per-rank batch of {per_rank} "
        f"(data.batch_size={batch_size} over {world} ranks) into equal micro-batches.",
        f"Set trainer.accumulate_grad_batches to a divisor of {per_rank} ({', '.join(map(str, divisors))}, ...), "
        "or change data.batch_size.",
    )]


def _no_decay_problems(settings: Settings) -> list[Problem]:
    config = settings.config
    if not (config.optim.no_decay_norm_and_bias and config.wrap.name == "fsdp"
            and config.wrap.kwargs.get("use_orig_params") is False):
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


def launcher_problems(settings: Settings, *, cluster_rendezvous: bool = False) -> list[Problem]:
    """The launcher group's processes, nodes and rendezvous; none when attached (torchrun/SLURM already decided
    processes and nodes, and the launcher group is unused). ``cluster_rendezvous``: the launch is checked before a
    cluster starts it (a submitit job, on the login node): its tasks will attach to the allocation's own rendezvous
    (``clusters.submitit.attach``: the job's first node), so several nodes need no ``launcher.rdzv_endpoint``."""
    if settings.attached:
        return []
    launcher = settings.config.launcher
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


def mesh_problems(settings: Settings) -> list[Problem]:
    """The mesh's degrees against the world, the wrap, the node and the batch."""
    from hydraddp.parallel.combinations import resolve_wrap

    combo = settings.combination
    world = combo.world_size
    try:
        shape = settings.mesh.resolved(world)
    except ValueError as exc:
        keys = ("mesh.pp", *MESH_KEYS) if settings.mesh.pp > 1 else MESH_KEYS
        return [Problem(keys, f"{exc}.",
                        f"Make {' x '.join(keys)} the world size ({world}), or leave mesh.dp_shard=-1 (the ranks "
                        "left).")]
    if not shape.multi_dimensional:
        return []
    wrap = resolve_wrap(combo)
    if shape.pp > 1:
        return _pipeline_problems(settings, shape, wrap)
    if shape.tp > 1 and wrap == "fsdp2":
        return _tp_problems(settings, shape)
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


def _pipeline_problems(settings: Settings, shape: MeshShape, wrap: str) -> list[Problem]:
    """Pipeline parallel's own limits: its wraps, its schedule, its microbatches against each pipeline's batch."""
    from hydraddp.parallel.pipeline import NotPipelinable, stages_per_rank_of

    mesh = settings.config.mesh
    if wrap not in ("fsdp2", "none") or (wrap == "none" and (shape.dp > 1 or shape.tp > 1)):
        return [Problem(("mesh.pp", "wrap"),
                        f"mesh.pp={shape.pp} with wrap={wrap}: each pipeline stage is sharded over its data-parallel "
                        "ranks and split over its TP ranks on FSDP2's device mesh (torchtitan's PP x FSDP2 x TP), "
                        "which ddp, fsdp (FSDP1), dp and horovod do not do per stage.",
                        "Use wrap=fsdp2 (or wrap=none with mesh.pp alone), or leave mesh.pp=1.")]
    if shape.tp > 1:
        found = _tp_problems(settings, shape)
        if found:
            return found
    try:
        stages = shape.pp * stages_per_rank_of(mesh.pp_schedule, mesh.pp_stages_per_rank)
    except NotPipelinable as exc:
        return [Problem(("mesh.pp_schedule", "mesh.pp_stages_per_rank"), f"{exc}.",
                        "Set mesh.pp_schedule=1F1B (one stage per rank), or Interleaved1F1B with "
                        "mesh.pp_stages_per_rank=2.")]
    found = _pipeline_limits(settings, shape)
    if found:
        return found
    microbatches = mesh.pp_microbatches or stages
    per_pipeline = settings.config.data.batch_size // shape.dp
    if microbatches < stages or per_pipeline % microbatches:
        return [Problem(("mesh.pp_microbatches", "data.batch_size"),
                        f"mesh.pp_microbatches={microbatches}: each pipeline's batch of {per_pipeline} "
                        f"(data.batch_size={settings.config.data.batch_size} over {shape.dp} data-parallel ranks) "
                        f"must split into at least {stages} microbatches (one per stage) of equal size.",
                        f"Set mesh.pp_microbatches to a divisor of {per_pipeline} of at least {stages}, or change "
                        "data.batch_size.")]
    return []


def _pipeline_limits(settings: Settings, shape: MeshShape) -> list[Problem]:
    """What pipeline stages do not combine with yet, each with its reason."""
    config = settings.config
    limits = [
        (config.precision.name == "fp16", ("mesh.pp", "precision"), "fp16's gradient scaler is not run across "
         "pipeline stages", "Use precision=bf16 or fp32."),
        (config.trainer.accumulate_grad_batches > 1, ("mesh.pp", "trainer.accumulate_grad_batches"),
         "a pipeline accumulates over its microbatches already", "Set mesh.pp_microbatches instead, and "
         "trainer.accumulate_grad_batches=1."),
    ]
    return [Problem(keys, f"mesh.pp={shape.pp}: {why}.", fix) for refused, keys, why, fix in limits if refused]


def _tp_problems(settings: Settings, shape: MeshShape) -> list[Problem]:
    """Tensor parallel's own limits: within one node, and a plan given as a mapping."""
    found = []
    nproc = settings.combination.nproc_per_node or settings.combination.world_size
    if shape.tp > nproc:
        found.append(Problem(("mesh.tp", "launcher.nproc_per_node"),
                             f"mesh.tp={shape.tp} is more than the {nproc} processes of a node: a TP group "
                             "exchanges activations at every layer, which only a node's own links are fast enough for.",
                             f"Set mesh.tp to at most {nproc} (a divisor of it), and shard or replicate across nodes "
                             "with mesh.dp_shard and mesh.dp_replicate."))
    plan = settings.config.wrap.tp_plan
    if plan is not None and not (isinstance(plan, dict) and all(isinstance(v, str) for v in plan.values())):
        found.append(Problem(("wrap.tp_plan",), f"wrap.tp_plan={plan!r} is not a mapping of module patterns to style "
                             "names.", "Write it as wrap.tp_plan='{layers.*.q: colwise, layers.*.o: rowwise}'."))
    return found


def tp_plan_problems(settings: Settings) -> list[Problem]:
    """``wrap.tp_plan`` given where no tensor parallel runs (it would be ignored)."""
    wrap, tp = settings.config.wrap, settings.config.mesh.tp
    if wrap.tp_plan and not (wrap.name == "fsdp2" and tp > 1):
        return [Problem(("wrap.tp_plan", "mesh.tp"),
                        f"wrap.tp_plan is set, but tensor parallel does not run (wrap={wrap.name}, "
                        f"mesh.tp={tp}): the plan would be ignored.",
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


def range_problems(settings: Settings) -> list[Problem]:
    """Batch sizes, steps, intervals and limits out of range, each with its key and the smallest valid value."""
    found = []
    for key, least in MINIMUMS.items():
        value = settings.get(key)
        if value is not None and value < least:
            meaning = "1 or more" if least == 1 else "0 or more"
            found.append(Problem((key,), f"{key}={value} is out of range.", f"Set {key} to {meaning}."))
    for key in POSITIVE:
        value = settings.get(key)
        if value is not None and value <= 0:
            found.append(Problem((key,), f"{key}={value} must be greater than 0.",
                                 f"Set {key} to a positive number{' or null' if key in NULLABLE else ''}."))
    return found
