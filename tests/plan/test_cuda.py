"""The plan's model of what CUDA adds to a step's peak (``hydraddp.plan.cuda``: cuBLAS's workspaces), against the
figures one NVIDIA H200 recorded (torch 2.11, GPT 512x4, seq 256, 16 sequences, one GPU, ``wrap=none``):
``max_memory_allocated`` over the second step was 823.5 MB in fp32 and 624.3 MB in bf16, where the simulated plan,
the same on any machine, says 738.5 and 514.1 MB (-10.3% and -17.6%)."""

import contextlib

import pytest

from hydraddp.config.compose import compose
from hydraddp.plan import cuda
from hydraddp.plan.estimate import estimate

MiB = 1024 * 1024
GPT = ["model=gpt", "data=text", "task=causal_lm", "model.dim=512", "model.depth=4", "model.heads=8",
       "data.seq_len=256", "data.batch_size=16", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
       "tracking.enabled=false", "wrap=none", "backend=none", "launcher.nproc_per_node=1"]
MEASURED_ON_H200 = {"fp32": 823.5e6, "bf16": 624.3e6}


def test_the_workspaces_are_torchs_per_handle_sizes_for_two_threads():
    assert cuda.workspace_bytes(hopper=True, env={}) == 2 * (32 * MiB + 1 * MiB)
    assert cuda.workspace_bytes(hopper=False, env={}) == 2 * (8 * MiB + 128 * 1024 + 1 * MiB)
    # CUBLAS_WORKSPACE_CONFIG as torch reads it (":SIZE_KiB:COUNT" pairs); cuBLASLt's own size, or none when unified
    assert cuda.workspace_bytes(True, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 2 * (32 * MiB + 1 * MiB)
    assert cuda.workspace_bytes(False, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 2 * (128 * 1024 + 1 * MiB)
    assert cuda.workspace_bytes(True, {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 2 * (32 * MiB + 4 * MiB)
    assert cuda.workspace_bytes(True, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 2 * 32 * MiB


def test_the_gpu_model_is_read_from_the_drivers_list(tmp_path):
    for bus, model in (("0000:18:00.0", "NVIDIA H200"), ("0000:2a:00.0", "NVIDIA H200")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 123\n")
    assert cuda.gpu_names(tmp_path) == ["NVIDIA H200", "NVIDIA H200"]
    assert cuda.planned_workspaces(["NVIDIA H100 80GB HBM3"], {}) == (2 * 33 * MiB, 0, None)
    smaller, margin, why = cuda.planned_workspaces([], {})  # planned elsewhere: the smaller size, and a margin
    assert smaller + margin == 2 * 33 * MiB and "Hopper" in why


@pytest.fixture(scope="module")
def simulated():
    return {precision: estimate(compose([*GPT, f"precision={precision}"]), world_size=1).peak_bytes
            for precision in MEASURED_ON_H200}


@pytest.mark.parametrize("precision", list(MEASURED_ON_H200))
def test_with_the_workspaces_the_plan_holds_the_h200s_max_memory_allocated_to_ten_percent(simulated, precision):
    measured = MEASURED_ON_H200[precision]
    planned = simulated[precision] + cuda.planned_workspaces(["NVIDIA H200"], {})[0]
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)
    assert simulated[precision] < planned < measured  # the workspaces were missing, and not all that was


def test_a_plan_for_a_gpu_counts_the_workspaces_in_its_peak(monkeypatch, simulated):
    monkeypatch.setattr(cuda, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(cuda, "gpu_names", lambda: ["NVIDIA H200"])
    planned = estimate(compose([*GPT, "precision=fp32"]), world_size=1)
    assert planned.cuda_workspace_bytes == cuda.workspace_bytes(True)
    # and the rest as CUDA runs it: here only each tensor's rounding to 512 bytes moves the peak
    assert 0 < planned.peak_bytes - planned.cuda_workspace_bytes - simulated["fp32"] < 64 * 1024


# --- the caching allocator's rounding: c10's round_size, AcceleratorAllocatorConfig's parsing -----------------------

def test_the_allocator_takes_multiples_of_512_bytes_and_nothing_for_an_empty_tensor():
    assert [cuda.allocated_bytes(n) for n in (0, 1, 511, 512, 513, 4 * MiB + 1)] == [
        0, 512, 512, 512, 1024, 4 * MiB + 512]


def test_power_of_two_divisions_round_as_torchs_round_size():
    four, two = [4] * cuda.ROUNDUP_INTERVALS, [2] * cuda.ROUNDUP_INTERVALS
    # 4500 lies between 4096 and 8192: four divisions at 5120, 6144 and 7168, two at 6144
    assert (cuda.allocated_bytes(4500, four), cuda.allocated_bytes(4500, two), cuda.allocated_bytes(4500)) == (
        5120, 6144, 4608)
    assert cuda.allocated_bytes(3 * MiB + 1, two) == 4 * MiB
    assert cuda.allocated_bytes(1 << 30, [8] * cuda.ROUNDUP_INTERVALS) == 1 << 30  # a power of 2 stays
    assert cuda.allocated_bytes(1200, four) == 1536  # not above 512 x divisions: 512-byte blocks


def test_the_divisions_are_read_from_the_allocator_config_as_torch_parses_it():
    assert cuda.roundup_power2_divisions("") == [0] * 16
    assert cuda.roundup_power2_divisions("expandable_segments:True,roundup_power2_divisions:4") == [4] * 16
    # a list: the first value up to its boundary's interval, each next one at its own, ">" after the last (MiB)
    assert cuda.roundup_power2_divisions("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]") == \
        [1] * 9 + [2, 4] + [8] * 5
    rounding = cuda.allocator_rounding({"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4"})
    assert rounding(4500) == 5120
    newer_first = {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:2", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    assert cuda.allocator_rounding(newer_first)(4500) == 6144 and cuda.allocator_rounding({})(4500) == 4608


def test_the_tensor_peak_counts_storages_as_the_allocator_sizes_them():
    import torch

    from hydraddp.train.metrics import TensorPeak

    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters())
    sizes = {}
    for name, allocated in (("own", None), ("cuda", cuda.allocator_rounding({}))):
        with TensorPeak(model, optimizer, allocated_bytes=allocated) as peak:
            held = [torch.zeros(3) for _ in range(10)]  # 12 bytes each
            del held
        sizes[name] = peak.peak_bytes
    # the model's weight and bias (4 bytes each) are counted too
    assert (sizes["own"], sizes["cuda"]) == (10 * 12 + 2 * 4, 10 * 512 + 2 * 512)


# --- the optimizer's kernels: foreach on CUDA --------------------------------------------------------------------

def test_an_optimizer_left_to_torch_runs_its_foreach_kernels_as_on_cuda():
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    default, single, fused = (torch.optim.AdamW(params), torch.optim.AdamW(params, foreach=False),
                              torch.optim.AdamW(params, fused=True))
    for optimizer in (default, single, fused):
        cuda.foreach_as_on_cuda(optimizer)
    assert [o.param_groups[0]["foreach"] for o in (default, single, fused)] == [True, False, None]


def test_a_plan_for_a_gpu_holds_adams_foreach_temporary_of_every_parameter(monkeypatch):
    """The peak of a model too small for its activations to matter is the optimizer step. AdamW's CPU loop holds two
    temporaries of one parameter at a time (``sqrt`` of its second moment, then divided); its CUDA default, foreach,
    one of every parameter at once."""
    overrides = ["model=mlp", "data=digits", "task=classification", "model.hidden=[1024,1024]",
                 "data.batch_size=2", "tracking.enabled=false", "wrap=none", "backend=none",
                 "launcher.nproc_per_node=1"]
    on_cpu = estimate(compose(overrides), world_size=1)
    monkeypatch.setattr(cuda, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(cuda, "gpu_names", lambda: ["NVIDIA H200"])
    on_gpu = estimate(compose(overrides), world_size=1)
    model_and_state = on_cpu.param_bytes + on_cpu.grad_bytes + on_cpu.optim_state_bytes
    largest = 1024 * 1024 * 4
    slack = 16 * 1024  # the step counters, and on the GPU each tensor's rounding to 512 bytes
    assert 0 <= on_cpu.peak_bytes - model_and_state - 2 * largest <= slack
    assert 0 <= on_gpu.peak_bytes - on_gpu.cuda_workspace_bytes - model_and_state - on_cpu.param_bytes <= slack


# --- the attention kernel: FlashAttention's backward ---------------------------------------------------------------

def test_flash_attentions_backward_workspace_is_its_fp32_accumulator_and_row_sums():
    import torch

    query = torch.empty(16, 8, 256, 64, device="meta")
    assert cuda.flash_backward_workspace(query) == [((16, 8, 256), torch.float32), ((16, 256, 8, 64), torch.float32)]
    odd = torch.empty(2, 4, 100, 80, device="meta")  # the sequence rounded to 128, the head size to 32
    assert cuda.flash_backward_workspace(odd) == [((2, 4, 128), torch.float32), ((2, 128, 4, 96), torch.float32)]
    big_head = torch.empty(1, 1, 1, 200, device="meta")
    assert cuda.flash_backward_workspace(big_head)[1][0] == (1, 128, 1, 256)
    assert cuda.picks_flash(query.to(torch.bfloat16), None)
    assert not cuda.picks_flash(query, None) and not cuda.picks_flash(query.half(), torch.empty(1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_attention_backward_holds_flashs_workspace_where_cuda_would_pick_flash(dtype):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hydraddp.train.metrics import TensorPeak

    dtype = getattr(torch, dtype)
    peaks = []
    with FakeTensorMode():
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters())
        q, k, v = (torch.randn(4, 8, 512, 64, dtype=dtype) for _ in range(3))
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        grad_out = torch.randn_like(out)
        for kernels in (contextlib.nullcontext(), cuda.KernelWorkspaces()):
            # the CPU kernel the simulation runs, alone: its three gradients (and CUDA's workspace beside them)
            with TensorPeak(model, optimizer) as peak, kernels:
                grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad_out, q, k, v, out, logsumexp, 0.0, True)
                del grads
            peaks.append(peak.peak_bytes)
    weights = 2 * 4  # the Linear's weight and bias, tracked from the start
    workspace = sum(torch.Size(shape).numel() * 4 for shape, _ in cuda.flash_backward_workspace(q))
    assert peaks[0] == weights + 3 * q.numel() * q.element_size()
    assert peaks[1] - peaks[0] == (workspace if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp", "fsdp2"])
def test_every_wrap_simulates_as_cuda_runs_it(wrap):
    """The CUDA kernels with each wrap's parameters (DDP's, FSDP1's flat ones, FSDP2's DTensors), at world 2 in bf16:
    only the optimizer's foreach temporaries, the attention workspace and the rounding move the peak, by little."""
    from hydraddp.plan.estimate import _simulate

    overrides = ["model=gpt", "data=text", "task=causal_lm", "model.dim=256", "model.depth=2", "model.heads=4",
                 "data.seq_len=128", "data.batch_size=8", "tracking.enabled=false", "backend=gloo",
                 "launcher.nproc_per_node=2", "precision=bf16", f"wrap={wrap}"]
    on_cpu, on_gpu = (_simulate(compose(overrides), 2, 0, on_cuda=on_cuda).peak.peak_bytes for on_cuda in (False, True))
    assert on_cpu != on_gpu and abs(on_gpu - on_cpu) < 0.01 * on_cpu, (on_cpu, on_gpu)
