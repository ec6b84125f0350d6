"""What the loop measures and reports: throughput, the logged losses (averaged over the ranks in few collectives),
MFU and peak memory."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import hydraddp.distributed as idist
from hydraddp.tracking import names
from hydraddp.tracking.events import EventWriter
from hydraddp.tracking.per_rank import step_time_metrics

log = logging.getLogger("hydraddp.train.loop")  # the loop's lines, under the name users filter on

# Steady-state throughput leaves out the first steps: they allocate, create the optimizer state and warm caches.
WARMUP_STEPS = 10
# Logged losses are averaged over the ranks in one all_reduce per this many steps at most.
SYNC_STEPS = 10
# Dense peak TFLOP/s per device model and compute dtype (the vendors' data sheets), for MFU: "bf16" (fp16 alike),
# "tf32" (fp32 matmuls on tensor cores, when torch allows it) and "fp32". Matched against the device's full name, the
# most specific name first: an H100 PCIe or NVL card is not the SXM part. Devices not listed report none rather than a
# guess; trainer.peak_tflops gives the figure for any device.
PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    ("H200 NVL", {"bf16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def peak_flops(device: torch.device, compute_dtype: torch.dtype = torch.bfloat16,
               peak_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s in ``compute_dtype`` (what the matmuls run in): ``peak_tflops`` when given (any
    device), else the table's figure for a CUDA device it names; None otherwise."""
    if peak_tflops:
        return float(peak_tflops) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = next((peaks for key, peaks in PEAK_TFLOPS if key in name), None)
    return peaks[_dtype_key(compute_dtype)] * 1e12 if peaks else None


def _dtype_key(compute_dtype: torch.dtype) -> str:
    if compute_dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA's max_memory_allocated on GPU; the process's peak RSS on CPU (ru_maxrss is in KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Throughput:
    """Samples per second: over each logging window, and at steady state (after the warm-up steps, with
    evaluation time left out)."""

    def __init__(self, start_step: int, last_step: int):
        self.warmup_end = start_step + min(WARMUP_STEPS, max(last_step - start_step - 1, 0))
        self.window_start, self.window_steps, self.window_samples = time.perf_counter(), 0, 0
        self.steady_start: float | None = None
        self.steady_samples, self.paused_s = 0, 0.0

    def count(self, step: int, samples: int) -> None:
        """One step of ``samples`` (over every rank)."""
        self.window_steps += 1
        self.window_samples += samples
        if self.steady_start is not None:
            self.steady_samples += samples
        if step == self.warmup_end:
            self.steady_start = time.perf_counter()

    def window(self) -> tuple[float, float]:
        """(samples/s, seconds per step) since the last call; starts the next window."""
        elapsed = time.perf_counter() - self.window_start
        rates = self.window_samples / elapsed, elapsed / max(self.window_steps, 1)
        self.window_start, self.window_steps, self.window_samples = time.perf_counter(), 0, 0
        return rates

    def leave_out(self, seconds: float) -> None:
        """Time spent on something else (evaluation), not counted at steady state."""
        if self.steady_start is not None:
            self.paused_s += seconds

    def steady(self) -> float:
        if self.steady_start is None or not self.steady_samples:
            return 0.0
        return self.steady_samples / (time.perf_counter() - self.steady_start - self.paused_s)


@dataclass
class _Logged:
    """A logged step whose loss is not averaged over the ranks yet."""

    step: int
    loss: torch.Tensor  # this rank's, shape (1,)
    perf: dict[str, float]
    at: float  # time.time() of the step, for the metrics' timestamps


class StepLog:
    """Logged steps wait here for their loss to be averaged over the ranks: one all_reduce per ``SYNC_STEPS`` steps at
    most, so logging every step costs no synchronization at every step. Then each goes to the console, to ``events``
    (the rank that writes the MLflow events) and to the progress bar."""

    def __init__(self, log_every: int, events: EventWriter | None, progress):
        self.sync_every = log_every * max(1, round(SYNC_STEPS / log_every))
        self.events, self.progress = events, progress
        self.pending: list[_Logged] = []
        self.losses: dict[int, float] = {}  # logged step -> loss averaged over the ranks

    def add(self, step: int, loss: torch.Tensor, perf: dict[str, float]) -> None:
        self.pending.append(_Logged(step, loss.detach().float().reshape(1), perf, time.time()))

    def flush(self, step: int, last_step: int) -> None:
        if not self.pending or (step % self.sync_every and step != last_step):
            return
        means = idist.all_reduce(torch.cat([entry.loss for entry in self.pending]), "AVERAGE").tolist()
        # Every rank's own step time of each pending step, for the straggler (the slowest rank), in one gather.
        own = torch.tensor([entry.perf[names.STEP_TIME_S] for entry in self.pending], dtype=torch.float64)
        times = idist.all_gather(own).reshape(idist.get_world_size(), len(self.pending)).T.tolist()
        for entry, mean_loss, step_times in zip(self.pending, means, times):
            self.losses[entry.step] = mean_loss
            if self.events is not None:
                self.events.metrics({names.LOSS: mean_loss, **entry.perf, **step_time_metrics(step_times)}, entry.step,
                                    at=entry.at)
            log.info("step %d loss %.4f %.0f samples/s", entry.step, mean_loss, entry.perf[names.SAMPLES_PER_S])
        if self.progress is not None:
            last = self.pending[-1].perf[names.SAMPLES_PER_S]
            self.progress.set_postfix(loss=f"{means[-1]:.4f}", samples_per_s=f"{last:.0f}")
        self.pending = []


class TensorPeak:
    """The peak of this rank's tensor memory over what runs inside, and its parts at that moment: torch's own
    ``MemTracker`` (it follows every storage through the dispatcher, so it works on the CPU, where no allocator
    keeps statistics). The model's parameters and gradients and the optimizer's state count from the start.
    On CUDA the peak is ``max_memory_allocated`` over the same span (the parts still come from the tracker)."""

    PARTS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
             "Temp": "temporary", "Optstate": "optimizer_state", "Other": "other"}

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device | None = None,
                 allocated_bytes: Callable[[int], int] | None = None):
        """``allocated_bytes``: what an allocator takes for a storage of so many bytes (the plan's model of CUDA's
        caching allocator, ``hydraddp.plan.cuda.allocator_rounding``); the storage's own size where None."""
        self.model, self.optimizer, self.device, self.allocated_bytes = model, optimizer, device, allocated_bytes
        self.peak_bytes, self.parts = 0, {}

    def __enter__(self) -> TensorPeak:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # A compiled model runs this step eagerly. Dynamo cannot trace under the tracker's dispatch mode, and a frame it
        # gave up on stays skipped: with the measured step (plan.measure, on by default) every later step of a
        # trainer.compile=true run, and every evaluation, ran eagerly (found with Dynamo's own frame counters).
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        self._tracker = _micro_batch_mem_tracker(self.allocated_bytes)
        self._tracker.track_external(self.model, self.optimizer)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._tracker.__exit__(*exc_info)
        self._eager.__exit__(*exc_info)
        totals: dict[str, int] = {}
        for per_device in self._tracker.get_tracker_snapshot("peak").values():
            for kind, nbytes in per_device.items():
                name = self.PARTS.get(getattr(kind, "value", kind), "total")
                totals[name] = totals.get(name, 0) + int(nbytes)
        self.peak_bytes = totals.pop("total", 0)
        if self.device is not None and self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        self.parts = totals


def _micro_batch_mem_tracker(allocated_bytes: Callable[[int], int] | None = None) -> Any:
    """torch's ``MemTracker``, for any step hydraddp runs, reading only the peak of the whole span (below: the stock
    tracker's per-module peaks cost a walk of every module after each operator). And changes where it raised:
    - The root module may run again inside one span, as gradient accumulation's micro-batches do ("does not support
      memory tracking for multiple iterative calls"): as its message suggests, the per-module stats restart
      (``reset_mod_stats``) while the peak of the whole span, which is all that is read here, carries on.
    - A module whose parameters are not leaves gets no gradient hooks ("post accumulate grad hooks cannot be
      registered on non-leaf tensors"): FSDP1 with ``use_orig_params=True`` makes them views of its flat parameter
      in the forward, and its gradients are counted on that flat parameter.
    - A frozen parameter (a LoRA model's base weights) gets none either ("cannot register a hook on a tensor that
      doesn't require gradient"): no gradient ever comes to it, so gradients count only what trains.
    - ``allocated_bytes``, where given, sizes each storage as that allocator would (the stock tracker rounds only
      storages on a CUDA device, and the plan's are on the CPU)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType

    class MicroBatchMemTracker(MemTracker):
        def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                         old_reftype: Any = None) -> None:
            if allocated_bytes is not None and u_type in (_UpdateType.ADD, _UpdateType.SIZE):
                winfo.mem_consumed = allocated_bytes(winfo.size * winfo.element_size)
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            tracker = self._mod_tracker
            again = module in self.memory_tracking and not tracker.is_bw
            if again and set(tracker.parents) - {tracker.get_known_fqn(module)} == {"Global"}:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            """The peak of the whole span only: the stock tracker also walks every module it has seen after each
            operator, for per-module peaks nothing here reads, which made a step cost operators x modules (a
            70B-sized plan ran for over ten minutes)."""
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = dict(snapshot)

        def _track_module_params_and_buffers(self, module: torch.nn.Module,
                                             install_grad_hooks: bool = True) -> tuple[int, int]:
            leaves = all(p.is_leaf for p in module.parameters())
            for param in module.parameters():  # the stock tracker hooks a parameter it holds no handles for
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks and leaves)

    return MicroBatchMemTracker()


class _NoHook:
    """The handle of a hook never installed (a frozen parameter's), for the tracker to remove at its end."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()
