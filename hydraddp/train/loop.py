"""A real training loop: optimizer and scheduler from config, precision, clipping, periodic evaluation.

``train`` reads top to bottom: ``_start`` builds this rank's parts (``_build``) and what the steps report to,
``_run_steps`` runs per step the task's step (``step.py``), the measurements (``metrics.py``), evaluation and the
checkpoint hooks (``resume.py``), and ``_finish`` evaluates and records the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import hydraddp.distributed as idist
from hydraddp.build import flops_per_token as model_flops_per_token
from hydraddp.build import data_mesh, instantiate_model, pipeline_stages, wrap_model
from hydraddp.parallel.precision import precision_spec
from hydraddp.config.instantiate import instantiate
from hydraddp import redaction
from hydraddp.handoff.preemption import signal_name, write_marker
from hydraddp.handoff.trial import TAG_PRUNED, TAG_PRUNED_STEP, TRIAL_ENV, TrialReporter, describe as describe_trial
from hydraddp.tracking import names
from hydraddp.tracking.events import EventWriter, write_report
from hydraddp.train import (checkpoint, data, inputs, model_snapshot, pipelined, preemption, pretrained, resume, rng,
                            tasks)
from hydraddp.train.logs import ConsoleHandler
from hydraddp.train.metrics import StepLog, TensorPeak, Throughput, peak_flops, peak_memory_bytes
from hydraddp.train.optim import parameter_groups
from hydraddp.train.evaluation import evaluate
from hydraddp.train.step import train_step

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    world_size: int
    final_loss: float
    samples_per_s: float
    step_time_s: float
    eval_loss: float | None = None
    eval_accuracy: float | None = None  # tasks that report accuracy
    eval_metrics: dict[str, float] = field(default_factory=dict)  # everything the task reports
    steady_samples_per_s: float = 0.0  # after the warm-up steps (metrics.WARMUP_STEPS), evaluation excluded
    first_step_at: float = 0.0  # wall-clock time (time.time()) when the first optimizer step ended
    losses: dict[int, float] = field(default_factory=dict)  # logged step -> loss averaged over ranks
    reports: list[dict[str, Any]] = field(default_factory=list)  # every rank's WrapReport after step 1
    peak_memory_bytes: list[int] = field(default_factory=list)  # per rank (see peak_memory_bytes)
    # Per rank, the same peak when training began: the model built, wrapped and loaded, the loaders made.
    build_peak_memory_bytes: list[int] = field(default_factory=list)
    # Per rank, over this launch's second step (plan.measure): the peak of tensor memory and its parts at that moment.
    tensor_peaks: list[dict[str, Any]] = field(default_factory=list)
    preempted: dict[str, Any] | None = None  # a signal stopped training: step, checkpoint, signal
    pruned_step: int | None = None  # a search's pruner stopped this trial after that step
    mfu: float | None = None  # the last logging window's model FLOP utilization, where the device's peak is known

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shown(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())


def _launched_at() -> float | None:
    value = os.environ.get(names.LAUNCHED_AT_ENV)
    return float(value) if value else None


def _progress(cfg: DictConfig, start_step: int):
    show = cfg.trainer.progress and idist.get_rank() == 0 and sys.stderr.isatty()
    if not show:
        return None
    from tqdm import tqdm

    ConsoleHandler.bar_active = True  # until _close_progress: log lines are written around the bar
    return tqdm(total=cfg.trainer.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)


def _close_progress(progress) -> None:
    if progress is not None:
        progress.close()
        ConsoleHandler.bar_active = False


@dataclass
class _Parts:
    """What one rank trains with."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    task: Any
    loader: Any
    eval_loader: Any
    resumed: checkpoint.Resumed | None
    flops_per_token: float | None  # the model's own count, taken before wrapping
    model_class: str  # what the model's _target_ built, before any wrapper
    train_set: Any
    eval_set: Any
    copies: int = 1  # the ranks that read (and count) the same batch: a TP group's, a pipeline's
    data_rank: int = 0  # this rank's data-parallel rank (``data.readers``): which share it reads, whose seeds it draws
    pipe: Any = None  # under pipeline parallel, this rank's stages and the schedule (``model``: its stages as one)

    @property
    def whole_model(self) -> nn.Module:
        """What evaluation and the logged model run: the model, or the pipeline's stages in turn."""
        return pipelined.Forward(self.pipe) if self.pipe is not None else self.model


def _build(cfg: DictConfig, job_dir: Path | None) -> _Parts:
    """The model (wrapped), optimizer, scheduler, grad scaler, task and loaders of ``cfg``, with a checkpoint loaded
    into them when the launch resumes."""
    bare = instantiate_model(cfg)
    model_class = f"{type(bare).__module__}.{type(bare).__qualname__}"  # before FSDP2 swaps the class in place
    flops_per_token = model_flops_per_token(bare)
    task = instantiate(cfg.task, "task")
    pipe = None
    if pipeline_stages(cfg) > 1:  # cut first, then each stage sharded (torchtitan's order)
        pipe = pipelined.build(cfg, bare, task, idist.device(), idist.get_world_size())
        model = pipelined.held(pipe)  # this rank's stages, as one module under the whole model's names
    else:
        model, _ = wrap_model(cfg, bare)
    params = parameter_groups(model, cfg.optim.no_decay_norm_and_bias)
    # model= lets Horovod's DistributedOptimizer name the gradients it reduces; it reduces after the last of the
    # accumulated backward passes (both ignored elsewhere).
    optimizer = idist.auto_optim(instantiate(cfg.optim.optimizer, "optim.optimizer")(params), model=model,
                                 backward_passes_per_step=cfg.trainer.accumulate_grad_batches)
    scheduler = instantiate(cfg.optim.scheduler, "optim.scheduler")(optimizer) if cfg.optim.scheduler else None
    scaler_settings = {k: cfg.precision[k] for k in ("init_scale", "growth_interval") if cfg.precision.get(k) is not None}
    scaler = idist.grad_scaler(model, **scaler_settings)
    root = resume.checkpoint_root(cfg, job_dir)
    if idist.get_nnodes() > 1 and root is not None and resume.needs_shared_root(cfg):
        checkpoint.check_shared(root)  # before anything is loaded or saved: one checkpoint holds every rank's shards
    resumed = resume.resume(cfg, job_dir, model, optimizer, scheduler, scaler)
    if resumed is None and cfg.model.get("pretrained"):  # a resume's checkpoint holds the weights to go on from
        pretrained.load(cfg.model.pretrained, model)
        log.info("weights loaded from %s", cfg.model.pretrained)
    train_set, eval_set = instantiate(cfg.data.dataset, "data.dataset")
    mesh = data_mesh(cfg)
    return _Parts(model, optimizer, scheduler, scaler, task,
                  data.train_loader(train_set, cfg.data.batch_size, cfg.data.num_workers, cfg.trainer.seed, mesh),
                  data.eval_loader(eval_set, cfg.data.eval_batch_size, cfg.data.num_workers, mesh), resumed,
                  flops_per_token, model_class, train_set, eval_set, mesh.tp * mesh.pp if mesh is not None else 1,
                  data.readers(mesh)[0], pipe)


def _after_first_step(parts: _Parts, result: TrainResult, step: int, job_dir: Path | None,
                      events: EventWriter | None, build_peak: int) -> None:
    """Startup time, every rank's memory peak when training began, and every rank's WrapReport now that gradients and
    optimizer state exist (the real shard sizes)."""
    result.first_step_at = time.time()
    launched_at = _launched_at()
    if events is not None and launched_at is not None:
        events.metrics({names.STARTUP_S: result.first_step_at - launched_at}, step)
    result.reports = [r.to_dict() for r in idist.wrap_report(parts.model, parts.optimizer).gather()]
    result.build_peak_memory_bytes = [int(p) for p in idist.all_gather(build_peak)]
    if events is not None:  # not before: a run this launch continues stays as it was until its first step
        events.tag(names.TAG_MODEL_CLASS, parts.model_class)
        events.metrics({**names.sharding_metrics(result.reports),
                        **names.per_rank_metrics(names.BUILD_PEAK_MEMORY, result.build_peak_memory_bytes)}, step)
        if job_dir is not None:
            write_report(job_dir, result.reports)


def _after_measured_step(peak: TensorPeak, result: TrainResult, step: int, events: EventWriter | None) -> None:
    """Every rank's measured tensor peak, for the plan's check (the tracker compares it with ``plan.json``)."""
    result.tensor_peaks = idist.all_gather({"peak_bytes": peak.peak_bytes, "parts": peak.parts})
    if events is not None:
        events.metrics(names.per_rank_metrics(names.PEAK_TENSOR, [p["peak_bytes"] for p in result.tensor_peaks]), step)


def _perf(throughput: Throughput, result: TrainResult, batch: Any, flops_per_token: float | None,
          device_flops: float | None, world: int, pipe: Any = None) -> dict[str, float]:
    """The logging window's samples/s and step time (kept in ``result``), MFU where the peak is known, and under
    pipeline parallel the last step's bubble on this rank."""
    result.samples_per_s, result.step_time_s = throughput.window()
    perf = {names.SAMPLES_PER_S: result.samples_per_s, names.STEP_TIME_S: result.step_time_s}
    if pipe is not None and pipe.bubble is not None:
        perf[names.PP_BUBBLE] = pipe.bubble
    tokens = tasks.tokens_per_sample(batch)
    if flops_per_token and device_flops and tokens:
        perf[names.MFU] = result.mfu = flops_per_token * result.samples_per_s * tokens / (device_flops * world)
    return perf


def _preempted(saver: resume.Saver, step: int, stop: preemption.Preemption, job_dir: Path | None) -> dict[str, Any]:
    """Every rank checkpoints ``step`` together; rank 0 records the preemption in the job directory."""
    path = saver.save(step)
    entry = {"step": step, "checkpoint": str(path) if path else None,
             "signal": signal_name(stop.received) if stop.received else "another rank's"}
    if idist.get_rank() == 0 and job_dir is not None and path is not None:
        write_marker(job_dir, entry)
    log.warning("stopped after step %d by %s; checkpoint %s", step, entry["signal"], path)
    return entry


def train(cfg: DictConfig, job_dir: Path | None = None, events: EventWriter | None = None,
          saved_config: dict[str, Any] | None = None) -> TrainResult:
    """Train ``cfg`` on this rank; every rank calls it. Returns the same result on every rank.

    ``events`` (on the one rank that writes them) receives the MLflow metrics as they happen.
    ``saved_config``: the config that checkpoints keep, with its secrets redacted (the launch knows which
    values came from the environment); by default ``cfg`` with its secret-looking keys redacted.
    """
    if saved_config is None:
        plain = OmegaConf.to_container(cfg, resolve=True)
        saved_config = redaction.redact(plain, redaction.secret_paths(plain))
    loop = _start(cfg, job_dir, events, saved_config)
    with preemption.Preemption(list(cfg.checkpoint.preempt_signals), cfg.checkpoint.preempt_check_every,
                               prunable=bool(os.environ.get(TRIAL_ENV))) as stop:
        batch = _run_steps(loop, stop)
    _close_progress(loop.progress)
    loop.saver.wait()  # a checkpoint still being written in the background is published before the launch ends
    if loop.result.preempted is not None:  # the job is about to be killed: no final evaluation
        result = loop.result
        result.losses, result.steps = loop.step_log.losses, result.preempted["step"]
        result.final_loss = result.losses.get(result.steps, float("nan"))
        return result
    return _finish(loop, batch)


@dataclass
class _Loop:
    """What the step loop carries, from ``_start`` to ``_finish``."""

    cfg: DictConfig
    job_dir: Path | None
    events: EventWriter | None
    parts: _Parts
    device: torch.device
    world: int
    build_peak: int  # this rank's memory peak when training began, gathered after the first step
    datasets: list[Any]  # described before the timed steps, recorded after the first
    horovod: bool
    device_flops: float | None
    start_step: int
    last_step: int
    result: TrainResult
    progress: Any
    batches: data.Batches
    saver: resume.Saver
    throughput: Throughput
    step_log: StepLog
    trial: TrialReporter | None  # a search's trial, on rank 0: reports each evaluation, asks whether to prune


def _start(cfg: DictConfig, job_dir: Path | None, events: EventWriter | None,
           saved_config: dict[str, Any]) -> _Loop:
    """This rank's parts built (and loaded, on a resume), and everything the steps report to."""
    device, world, trainer = idist.device(), idist.get_world_size(), cfg.trainer
    parts = _build(cfg, job_dir)
    build_peak = peak_memory_bytes(device)  # gathered after the first step, with the reports
    model, task = parts.model, parts.task
    # Described now, outside the timed steps; recorded after the first step, as the tags are (a continued run must
    # stay as it was until this launch has taken a step).
    datasets = (inputs.describe_datasets(saved_config, parts.train_set, parts.eval_set)
                if events is not None and cfg.tracking.datasets else [])
    horovod = idist.backend() == "horovod"
    device_flops = peak_flops(device, precision_spec(cfg.precision.name).compute_dtype, trainer.get("peak_tflops"))
    start_step = parts.resumed.step if parts.resumed else 0
    last_step = min(trainer.max_steps, trainer.stop_at_step or trainer.max_steps)
    result = TrainResult(steps=0, world_size=world, final_loss=float("nan"), samples_per_s=0.0, step_time_s=0.0)
    progress = _progress(cfg, start_step)
    rng.seed_rank(trainer.seed, parts.data_rank, start_step)  # the model was built alike on every rank; now its own
    batches = data.Batches(parts.loader, start_step, trainer.seed, parts.resumed.loader if parts.resumed else None,
                           parts.data_rank)
    if parts.resumed is not None:
        rng.restore(parts.resumed.rng)  # now: nothing draws between here and the first step
    # What will really run: the realized wrapper (wrap=auto decided), and the steps left after a resume.
    realized = getattr(getattr(model, "_hydraddp_wrap", None), "wrap", cfg.wrap.name)
    log.info("training steps %d-%d of %d: wrap=%s precision=%s task=%s on %s, world size %d", start_step + 1,
             last_step, trainer.max_steps, realized, cfg.precision.name, type(task).__name__, device, world)
    saver = resume.Saver(cfg, job_dir, model, parts.optimizer, parts.scheduler, parts.scaler, saved_config, events,
                         loader_state=batches.state_dict)
    throughput, step_log = Throughput(start_step, last_step), StepLog(trainer.log_every, events, progress)
    trial = TrialReporter.from_env() if idist.get_rank() == 0 else None
    described = describe_trial(cfg)
    if described:  # every rank says what it trains with of the searched keys
        log.info(described)
    return _Loop(cfg, job_dir, events, parts, device, world, build_peak, datasets, horovod, device_flops, start_step,
                 last_step, result, progress, batches, saver, throughput, step_log, trial)


def _run_steps(loop: _Loop, stop: preemption.Preemption) -> Any:
    """Steps ``start_step + 1`` to ``last_step``, or until a preemption every rank agreed on. Returns the last batch
    (None when no step ran)."""
    cfg, parts, result, events, trainer = loop.cfg, loop.parts, loop.result, loop.events, loop.cfg.trainer
    model, task, device, last_step = parts.model, parts.task, loop.device, loop.last_step
    batch = None
    for step in range(loop.start_step + 1, last_step + 1):
        batch = tasks.to_device(next(loop.batches), device)
        # The second step, as the plan counts it: optimizer state made, nothing allocated for the first time. (Not
        # with several stages on a rank: their passes interleave, which torch's tracker does not follow, and the plan
        # does not simulate them.)
        measuring = cfg.plan.measure and step == loop.start_step + 2 and (
            parts.pipe is None or len(parts.pipe.stages) == 1)
        with TensorPeak(model, parts.optimizer, device) if measuring else contextlib.nullcontext() as peak:
            if parts.pipe is not None:
                loss = pipelined.train_step(parts.pipe, batch, parts.optimizer, trainer.grad_clip)
            else:
                loss = train_step(model, task, batch, parts.optimizer, parts.scaler, trainer.grad_clip, loop.horovod,
                                  trainer.accumulate_grad_batches)
        if measuring:
            _after_measured_step(peak, result, step, events)
        if parts.scheduler is not None:
            parts.scheduler.step()
        loop.throughput.count(step, tasks.batch_size(batch) * loop.world // parts.copies)  # samples, not copies
        if step == loop.start_step + 1:
            _after_first_step(parts, result, step, loop.job_dir, events, loop.build_peak)
            if events is not None:
                inputs.record(events, loop.datasets)
        stopping = stop.agreed(step)  # every rank the same answer, at the same step
        if step % trainer.log_every == 0 or step == last_step or stopping:
            loop.step_log.add(step, loss, _perf(loop.throughput, result, batch, parts.flops_per_token,
                                                loop.device_flops, loop.world, parts.pipe))
        loop.step_log.flush(step, step if stopping else last_step)
        if trainer.eval_every and step % trainer.eval_every == 0 and step != last_step and not stopping:
            metrics = _evaluate_between_steps(loop, step)
            if loop.trial is not None and loop.trial.should_prune(step, metrics, loop.step_log.losses.get(step)):
                stop.request_prune()
            if stop.prunable:  # every rank learns rank 0's answer now, with any signal's
                stopping = stop.agree_now()
        if stopping and stop.pruned:  # a finished run, only shorter: no checkpoint is owed; _finish evaluates
            log.info("the search pruned this trial: stopping after step %d", step)
            result.pruned_step = loop.last_step = step
            if events is not None:
                events.tag(TAG_PRUNED, "true")
                events.tag(TAG_PRUNED_STEP, str(step))
            break
        loop.saver.after(step, last_step, batch)
        if loop.progress is not None:
            loop.progress.update(1)
        if stopping:
            result.preempted = _preempted(loop.saver, step, stop, loop.job_dir)
            break
    return batch


def _evaluate_between_steps(loop: _Loop, step: int) -> dict[str, float]:
    """A periodic evaluation, its time left out of the throughput."""
    eval_began = time.perf_counter()
    parts = loop.parts
    metrics = evaluate(parts.whole_model, parts.eval_loader, loop.device, parts.task, parts.copies).metrics
    loop.throughput.leave_out(time.perf_counter() - eval_began)
    log.info("step %d eval %s", step, _shown(metrics))
    if loop.events is not None:
        loop.events.metrics(names.eval_metrics(metrics), step)
    return metrics


def _finish(loop: _Loop, batch: Any) -> TrainResult:
    """The end of a run that was not preempted: the final evaluation, every rank's memory peak and the logged
    model."""
    cfg, parts, result, events, last_step = loop.cfg, loop.parts, loop.result, loop.events, loop.last_step
    result.steady_samples_per_s = loop.throughput.steady()
    result.losses = loop.step_log.losses
    result.steps, result.final_loss = last_step, result.losses.get(last_step, float("nan"))
    result.eval_metrics = evaluate(parts.whole_model, parts.eval_loader, loop.device, parts.task, parts.copies).metrics
    result.eval_loss, result.eval_accuracy = result.eval_metrics.get("loss"), result.eval_metrics.get("accuracy")
    peaks = idist.all_gather(peak_memory_bytes(loop.device))
    result.peak_memory_bytes = [int(p) for p in peaks]
    if events is not None:
        events.metrics({**names.eval_metrics(result.eval_metrics),
                        **names.per_rank_metrics(names.PEAK_MEMORY, peaks)}, last_step)
    if cfg.tracking.enabled and cfg.tracking.model.enabled:
        last_batch = batch if last_step > loop.start_step else None  # None: no step
        model_snapshot.record_model(cfg, parts.whole_model, last_batch, last_step, events, loop.job_dir, loop.saver)
    log.info("done: loss %.4f, eval %s", result.final_loss, _shown(result.eval_metrics))
    return result
