"""A real training loop: optimizer and scheduler from config, precision, clipping, periodic evaluation."""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import hydraddp.distributed as idist
from hydraddp.build import flops_per_token as model_flops_per_token
from hydraddp.build import instantiate_model, wrap_model
from hydraddp.config.instantiate import instantiate
from hydraddp.tracking import names
from hydraddp.tracking.events import EventWriter, write_report
from hydraddp.train import checkpoint, data, tasks
from hydraddp.train.logs import ConsoleHandler
from hydraddp.train.optim import parameter_groups
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
    steady_samples_per_s: float = 0.0  # after the first WARMUP_STEPS steps, evaluation excluded
    first_step_at: float = 0.0  # wall-clock time (time.time()) when the first optimizer step ended
    losses: dict[int, float] = field(default_factory=dict)  # logged step -> loss averaged over ranks
    reports: list[dict[str, Any]] = field(default_factory=list)  # every rank's WrapReport after step 1
    peak_memory_bytes: list[int] = field(default_factory=list)  # per rank (see peak_memory_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shown(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())


class Evaluation(NamedTuple):
    metrics: dict[str, float]  # the task's, e.g. loss and accuracy, or loss and perplexity
    samples: int  # every sample of the eval set exactly once, summed over the ranks


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, task: Any = None) -> Evaluation:
    """The task's metrics over the eval set: every rank's sums added in one all-reduce, then summarized."""
    task = task if task is not None else tasks.Classification()
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    samples = 0
    for batch in loader:
        batch = tasks.to_device(batch, device)
        samples += tasks.batch_size(batch)
        for key, value in tasks.eval_sums(task, model, batch).items():
            sums[key] = sums.get(key, 0) + value.detach().to(device, torch.float64)
    model.train()
    # A rank whose shard is empty has no keys yet: every rank reduces the same keys, in the same order.
    keys = sorted({key for rank_keys in idist.all_gather(sorted(sums)) for key in rank_keys})
    zero = torch.zeros((), dtype=torch.float64, device=device)
    totals = idist.all_reduce(torch.stack([*(sums.get(k, zero) for k in keys), zero + samples])).tolist()
    return Evaluation(tasks.summarize(task, dict(zip(keys, totals))), int(totals[-1]))


# Steady-state throughput leaves out the first steps: they allocate, create the optimizer state and warm caches.
WARMUP_STEPS = 10


SYNC_STEPS = 10


@dataclass
class _Logged:
    """A logged step whose loss is not averaged over the ranks yet."""

    step: int
    loss: torch.Tensor  # this rank's, shape (1,)
    perf: dict[str, float]
    at: float  # time.time() of the step, for the metrics' timestamps


def _report(logged: list[_Logged], result: TrainResult, events: EventWriter | None, progress) -> None:
    """Average the losses of ``logged`` over the ranks in one all_reduce, then log and record every step."""
    means = idist.all_reduce(torch.cat([entry.loss for entry in logged]), "AVERAGE").tolist()
    for entry, mean_loss in zip(logged, means):
        result.losses[entry.step] = mean_loss
        if events is not None:
            events.metrics({names.LOSS: mean_loss, **entry.perf}, entry.step, at=entry.at)
        log.info("step %d loss %.4f %.0f samples/s", entry.step, mean_loss, entry.perf[names.SAMPLES_PER_S])
    if progress is not None:
        progress.set_postfix(loss=f"{means[-1]:.4f}", samples_per_s=f"{logged[-1].perf[names.SAMPLES_PER_S]:.0f}")


def _launched_at() -> float | None:
    value = os.environ.get(names.LAUNCHED_AT_ENV)
    return float(value) if value else None


# Dense bf16 peak FLOP/s per device, for MFU; devices not listed report none rather than a guess.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA's max_memory_allocated on GPU; the process's peak RSS on CPU (ru_maxrss is in KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _checkpoint_root(cfg: DictConfig, job_dir: Path | None) -> Path | None:
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return Path(job_dir, "checkpoints") if job_dir is not None else None


def _resume(cfg: DictConfig, job_dir: Path | None, model, optimizer, scheduler, scaler) -> checkpoint.Resumed | None:
    """Load the checkpoint to continue from: ``checkpoint.resume``, or after an elastic restart the latest one."""
    path = cfg.checkpoint.resume
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    root = _checkpoint_root(cfg, job_dir)
    if restart and root is not None and checkpoint.complete_checkpoints(root):
        path = str(checkpoint.complete_checkpoints(root)[-1])  # this launch's own latest: go on from there
        log.info("restarted from %s (restart %d by torch's elastic agent)", path, restart)
    if not path:
        return None
    resumed = checkpoint.load(Path(path), model, optimizer)
    if scheduler is not None and resumed.meta.get("scheduler"):
        scheduler.load_state_dict(resumed.meta["scheduler"])
    if scaler is not None and resumed.meta.get("scaler"):
        scaler.load_state_dict(resumed.meta["scaler"])
    return resumed


class _Saver:
    """Periodic, early-stop and final checkpoints, as ``cfg.checkpoint`` says."""

    def __init__(self, cfg: DictConfig, job_dir: Path | None, model, optimizer, scheduler, scaler,
                 saved_config: dict[str, Any]):
        self.cfg, self.job_dir, self.saved_config = cfg, job_dir, saved_config
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.root = _checkpoint_root(cfg, job_dir)

    def after(self, step: int, last_step: int) -> None:
        every, ckpt = self.cfg.checkpoint.every_n_steps, self.cfg.checkpoint
        periodic = every and step % every == 0
        final = step == last_step and (ckpt.save_last or step == self.cfg.trainer.stop_at_step)
        if self.root is None or not (periodic or final):
            return
        run_id_file = Path(self.job_dir, names.RUN_ID_FILE) if self.job_dir else None
        meta = {
            "config": self.saved_config,
            "run_id": run_id_file.read_text().strip() if run_id_file and run_id_file.exists() else None,
            # The tracker may create the run after this save (it yields the CPU to training): a resume
            # then reads the run id from the job directory.
            "job_dir": str(self.job_dir) if self.job_dir else None,
            "wrap": getattr(getattr(self.model, "_hydraddp_wrap", None), "wrap", None),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
        checkpoint.save(self.root, step, self.model, self.optimizer, meta, keep_last=ckpt.keep_last)


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


def train(cfg: DictConfig, job_dir: Path | None = None, events: EventWriter | None = None,
          saved_config: dict[str, Any] | None = None) -> TrainResult:
    """Train ``cfg`` on this rank; every rank calls it. Returns the same result on every rank.

    ``events`` (on the one rank that writes them) receives the MLflow metrics as they happen.
    ``saved_config``: the config that checkpoints keep, with its secrets redacted (the launch knows which
    values came from the environment); by default ``cfg`` with its secret-looking keys redacted.
    """
    if saved_config is None:
        plain = OmegaConf.to_container(cfg, resolve=True)
        saved_config = names.redact(plain, names.secret_paths(plain))
    device, world = idist.device(), idist.get_world_size()
    bare = instantiate_model(cfg)
    if events is not None:
        events.tag(names.TAG_MODEL_CLASS, f"{type(bare).__module__}.{type(bare).__qualname__}")
    flops_per_token, device_flops = model_flops_per_token(bare), peak_flops(device)
    model, _ = wrap_model(cfg, bare)
    params = parameter_groups(model, cfg.optim.no_decay_norm_and_bias)
    accumulate = cfg.trainer.accumulate_grad_batches
    # model= lets Horovod's DistributedOptimizer name the gradients it reduces; it reduces after the last of the
    # accumulated backward passes (both ignored elsewhere).
    optimizer = idist.auto_optim(instantiate(cfg.optim.optimizer, "optim.optimizer")(params), model=model,
                                 backward_passes_per_step=accumulate)
    horovod = idist.backend() == "horovod"
    scheduler = instantiate(cfg.optim.scheduler, "optim.scheduler")(optimizer) if cfg.optim.scheduler else None
    scaler_settings = {k: cfg.precision[k] for k in ("init_scale", "growth_interval") if cfg.precision.get(k) is not None}
    scaler = idist.grad_scaler(model, **scaler_settings)
    ckpt, root = cfg.checkpoint, _checkpoint_root(cfg, job_dir)
    if idist.get_nnodes() > 1 and root is not None and (ckpt.every_n_steps or ckpt.save_last or ckpt.resume or
                                                        cfg.trainer.stop_at_step):
        checkpoint.check_shared(root)  # before anything is loaded or saved: one checkpoint holds every rank's shards
    resumed = _resume(cfg, job_dir, model, optimizer, scheduler, scaler)
    start_step = resumed.step if resumed else 0
    task = instantiate(cfg.task, "task")
    train_set, eval_set = instantiate(cfg.data.dataset, "data.dataset")
    loader = data.train_loader(train_set, cfg.data.batch_size, cfg.data.num_workers, cfg.trainer.seed)
    eval_loader = data.eval_loader(eval_set, cfg.data.eval_batch_size, cfg.data.num_workers)
    trainer = cfg.trainer

    result = TrainResult(steps=0, world_size=world, final_loss=float("nan"), samples_per_s=0.0, step_time_s=0.0)
    progress = _progress(cfg, start_step)
    batches = data.Batches(loader, start_step, cfg.trainer.seed)
    if resumed is not None:
        checkpoint.restore_rng(resumed.rng)  # now: nothing draws between here and the first step
    last_step = min(trainer.max_steps, trainer.stop_at_step or trainer.max_steps)
    # What will really run: the realized wrapper (wrap=auto decided), and the steps left after a resume.
    realized = getattr(getattr(model, "_hydraddp_wrap", None), "wrap", cfg.wrap.name)
    log.info("training steps %d-%d of %d: wrap=%s precision=%s task=%s on %s, world size %d", start_step + 1,
             last_step, trainer.max_steps, realized, cfg.precision.name, type(task).__name__, device, world)
    saver = _Saver(cfg, job_dir, model, optimizer, scheduler, scaler, saved_config)
    window_start, window_steps, window_samples = time.perf_counter(), 0, 0
    # Logged steps wait here for their loss to be averaged over the ranks: one all_reduce per SYNC_STEPS steps
    # at most, so logging every step costs no synchronization at every step.
    logged: list[_Logged] = []
    sync_every = trainer.log_every * max(1, round(SYNC_STEPS / trainer.log_every))
    steady_start, steady_samples, eval_seconds = None, 0, 0.0
    warmup_end = start_step + min(WARMUP_STEPS, max(last_step - start_step - 1, 0))
    for step in range(start_step + 1, last_step + 1):
        batch = tasks.to_device(next(batches), device)
        loss = train_step(model, task, batch, optimizer, scaler, trainer.grad_clip, horovod, accumulate)
        samples = tasks.batch_size(batch)
        if scheduler is not None:
            scheduler.step()
        window_steps += 1
        window_samples += samples * world
        if steady_start is not None:
            steady_samples += samples * world
        if step == warmup_end:
            steady_start = time.perf_counter()
        if step == start_step + 1:
            result.first_step_at = time.time()
            launched_at = _launched_at()
            if events is not None and launched_at is not None:
                events.metrics({names.STARTUP_S: result.first_step_at - launched_at}, step)
            # Grads and optimizer state exist now: the shard sizes are the real ones.
            result.reports = [r.to_dict() for r in idist.wrap_report(model, optimizer).gather()]
            if events is not None:
                events.metrics(names.sharding_metrics(result.reports), step)
                if job_dir is not None:
                    write_report(job_dir, result.reports)
        if step % trainer.log_every == 0 or step == last_step:
            elapsed = time.perf_counter() - window_start
            result.samples_per_s, result.step_time_s = window_samples / elapsed, elapsed / window_steps
            perf = {names.SAMPLES_PER_S: result.samples_per_s, names.STEP_TIME_S: result.step_time_s}
            tokens = tasks.tokens_per_sample(batch)
            if flops_per_token and device_flops and tokens:
                tokens_per_s = result.samples_per_s * tokens
                perf[names.MFU] = flops_per_token * tokens_per_s / (device_flops * world)
            logged.append(_Logged(step, loss.detach().float().reshape(1), perf, time.time()))
            window_start, window_steps, window_samples = time.perf_counter(), 0, 0
        if logged and (step % sync_every == 0 or step == last_step):
            _report(logged, result, events, progress)
            logged = []
        if trainer.eval_every and step % trainer.eval_every == 0 and step != last_step:
            eval_began = time.perf_counter()
            metrics = evaluate(model, eval_loader, device, task).metrics
            if steady_start is not None:
                eval_seconds += time.perf_counter() - eval_began
            log.info("step %d eval %s", step, _shown(metrics))
            if events is not None:
                events.metrics(names.eval_metrics(metrics), step)
        saver.after(step, last_step)
        if progress is not None:
            progress.update(1)
    _close_progress(progress)
    if steady_start is not None and steady_samples:
        result.steady_samples_per_s = steady_samples / (time.perf_counter() - steady_start - eval_seconds)
    result.steps, result.final_loss = last_step, result.losses.get(last_step, float("nan"))
    result.eval_metrics = evaluate(model, eval_loader, device, task).metrics
    result.eval_loss, result.eval_accuracy = result.eval_metrics.get("loss"), result.eval_metrics.get("accuracy")
    peaks = idist.all_gather(peak_memory_bytes(device))
    result.peak_memory_bytes = [int(p) for p in peaks]
    if events is not None:
        events.metrics({**names.eval_metrics(result.eval_metrics),
                        **names.per_rank_metrics(names.PEAK_MEMORY, peaks)}, last_step)
    log.info("done: loss %.4f, eval %s", result.final_loss, _shown(result.eval_metrics))
    return result
