"""The GPU-only paths of the core, for real: nccl, DataParallel, CPU offload, fp16 grad scaling, SyncBatchNorm.

Run on a GPU machine with tests/gpu/run.sh; without CUDA, conftest.py skips them all. Tests for 2 ranks
need 2 GPUs (NCCL refuses two ranks on one device). Offload and fp16 also run at world 1 on one GPU, so a
one-GPU machine still tests something.
"""

import pytest
import torch

from tests.distributed.test_parity import BF16_TOL, max_param_diff
from tests.helpers.spawn import run_parallel

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, this machine has {GPUS}")
BF16_OK = GPUS > 0 and torch.cuda.is_bf16_supported()
bf16 = pytest.mark.skipif(GPUS > 0 and not BF16_OK, reason="this GPU has no bf16 support")
ONE_AND_TWO_GPUS = [pytest.param(1, id="1gpu"), pytest.param(2, id="2gpu", marks=two_gpus)]

# CPU parity holds to 1e-5 (tests/distributed/test_parity.py). On GPU, 8-row and 16-row batches run
# different cuBLAS kernels that sum in different orders; 1e-4 still catches a real averaging or sharding
# mistake, which changes each step by about lr * gradient (~1e-2 here).
FP32_TOL = 1e-4
# fp16 with a grad scaler tracks fp32 to ~1e-4 in a CPU simulation of these 5 steps; the margin lets the
# scaler skip a step, which it may legitimately do while it finds its scale.
FP16_TOL = 5e-2
PRECISIONS = ("fp32", "bf16") if BF16_OK else ("fp32",)
WRAPS = ("auto", "ddp", "fsdp", "fsdp2")  # auto must realize as DDP on 2 ranks (ignite's rule)


def finite(values) -> bool:
    return bool(torch.isfinite(torch.tensor(values)).all())


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """The reference: one process, no process group, an unwrapped model on one GPU, same global batch."""
    cases = [("none", p) for p in PRECISIONS]
    return run_parallel("tests.gpu.workers:parity_runs", cases, backend="none", nproc=1,
                        tmp_path=tmp_path_factory.mktemp("one_gpu"), timeout=180)[0]


@pytest.fixture(scope="module")
def nccl_runs(tmp_path_factory):
    cases = [(w, p) for w in WRAPS for p in PRECISIONS]
    return run_parallel("tests.gpu.workers:nccl_parity", cases, backend="nccl", nproc=2,
                        tmp_path=tmp_path_factory.mktemp("nccl"), timeout=240)


@two_gpus
def test_nccl_auto_model_is_ddp_on_the_local_rank_gpu(nccl_runs):
    assert sorted(out["auto"]["local_rank"] for out in nccl_runs.values()) == [0, 1]
    for out in nccl_runs.values():
        auto, local_rank = out["auto"], out["auto"]["local_rank"]
        assert auto["backend"] == "nccl"
        assert auto["type"] == "DistributedDataParallel"
        assert auto["device_ids"] == [local_rank]
        assert auto["device"] == f"cuda:{local_rank}"
        assert auto["param_devices"] == [f"cuda:{local_rank}"]


@two_gpus
@pytest.mark.parametrize("precision", [pytest.param("fp32"), pytest.param("bf16", marks=bf16)])
@pytest.mark.parametrize("wrap", WRAPS)
def test_nccl_training_matches_one_gpu(one_gpu, nccl_runs, wrap, precision):
    tol = FP32_TOL if precision == "fp32" else BF16_TOL
    one, two = one_gpu[("none", precision)], nccl_runs[0]["runs"][(wrap, precision)]
    report = two["report"]
    assert (report["wrapper"], report["backend"], report["world_size"]) == ("ddp" if wrap == "auto" else wrap, "nccl", 2)
    assert len(two["losses"]) == 5
    assert two["losses"] == pytest.approx(one["losses"], abs=tol)
    assert max_param_diff(two["params"], one["params"]) < tol
    # Training really changed something (a parity of nothing would pass too).
    assert one["losses"][0] - one["losses"][-1] > 0.01


@two_gpus
@pytest.mark.parametrize("wrap", WRAPS)
def test_nccl_ranks_agree_on_the_full_parameters(nccl_runs, wrap):
    assert max_param_diff(nccl_runs[0]["runs"][(wrap, "fp32")]["params"], nccl_runs[1]["runs"][(wrap, "fp32")]["params"]) == 0


@pytest.fixture(scope="module")
def dataparallel(tmp_path_factory):
    cases = {"auto": {}, "dp": {"wrap": "dp"}}
    if BF16_OK:
        cases["dp_bf16"] = {"wrap": "dp", "precision": "bf16"}
    return run_parallel("tests.gpu.workers:dataparallel_cases", cases, backend="none", nproc=1,
                        tmp_path=tmp_path_factory.mktemp("dp"), timeout=180)[0]


@two_gpus
@pytest.mark.parametrize("case", ["auto", "dp"])
def test_dataparallel_without_a_process_group(dataparallel, case):
    out = dataparallel[case]
    assert out["error"] is None, out["error"]
    assert out["type"] == "DataParallel"
    assert out["device_ids"] == list(range(GPUS))
    assert out["wrapper"] == "dp"
    # DataParallel splits the batch over the GPUs and sums the replicas' gradients: the full-batch result.
    assert out["all_grads"]
    assert out["loss"] == pytest.approx(out["ref_loss"], abs=1e-5)
    assert out["max_grad_diff"] < 1e-5


@two_gpus
@bf16
def test_dataparallel_with_bf16_autocast(dataparallel):
    # The precision hooks sit on the model that DataParallel copies to each GPU, so each replica enters autocast
    # in bf16 in its own thread (autocast state is per thread: wrapping DataParallel's forward left them in fp16).
    out = dataparallel["dp_bf16"]
    assert out["error"] is None, out["error"]
    assert out["type"] == "DataParallel"
    assert out["compute_dtypes"] == ["torch.bfloat16"]
    assert out["all_grads"]
    assert out["loss"] == pytest.approx(out["ref_loss"], abs=BF16_TOL)


@pytest.fixture(scope="module", params=ONE_AND_TWO_GPUS)
def offload(request, tmp_path_factory):
    nproc = request.param
    runs = run_parallel("tests.gpu.workers:offload_runs", ["fsdp", "fsdp2"], backend="nccl", nproc=nproc,
                        tmp_path=tmp_path_factory.mktemp("offload"), timeout=240)
    return nproc, runs


@pytest.mark.parametrize("wrap", ["fsdp", "fsdp2"])
def test_cpu_offload_trains_with_shards_on_the_cpu(offload, wrap):
    nproc, runs = offload
    assert sorted(runs) == list(range(nproc))
    for run in (by_wrap[wrap] for by_wrap in runs.values()):
        report = run["report"]
        assert (report["wrapper"], report["offload"], report["world_size"]) == (wrap, "cpu", nproc)
        assert run["backend"] == "nccl"  # ignite's name, though the group is nccl with a gloo side for CPU tensors
        assert run["group_backend"] in (None, "cuda:nccl,cpu:gloo")
        assert run["shard_devices"] == ["cpu"]
        assert run["grad_devices"] == ["cpu"]
        # Offloading moves tensors, not arithmetic: the same clipped steps as on the GPU alone.
        assert run["losses"] == pytest.approx(run["reference_losses"], abs=FP32_TOL)


FP16_WRAPS = ("ddp", "fsdp", "fsdp2")
SCALERS = {
    "ddp": f"{torch.amp.GradScaler.__module__}.{torch.amp.GradScaler.__qualname__}",
    "fsdp": "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
    "fsdp2": "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
}


@pytest.fixture(scope="module", params=ONE_AND_TWO_GPUS)
def fp16(request, tmp_path_factory):
    return run_parallel("tests.gpu.workers:fp16_runs", list(FP16_WRAPS), backend="nccl", nproc=request.param,
                        tmp_path=tmp_path_factory.mktemp("fp16"), timeout=240)


@pytest.mark.parametrize("wrap", FP16_WRAPS)
def test_fp16_with_the_grad_scaler_trains_like_fp32(fp16, wrap):
    run = fp16[0][wrap]
    # Exact class names: ShardedGradScaler subclasses GradScaler, so isinstance could not tell them apart.
    assert run["scaler"] == SCALERS[wrap]
    assert (run["report"]["precision"], run["report"]["param_dtype"]) == ("fp16", "float16")
    assert finite(run["losses"])
    assert run["scale"] > 0
    assert run["losses"] == pytest.approx(run["fp32_losses"], abs=FP16_TOL)
    # The 5 fp32 steps move some parameter by ~0.1: a scaler that never stepped or never unscaled shows here.
    assert max_param_diff(run["params"], run["fp32_params"]) < FP16_TOL


@two_gpus
def test_sync_bn_under_ddp_becomes_syncbatchnorm_and_trains(tmp_path):
    runs = run_parallel("tests.gpu.workers:sync_bn_run", "ddp", "fp32", backend="nccl", nproc=2,
                        tmp_path=tmp_path, timeout=180)
    for out in runs.values():
        assert out["type"] == "DistributedDataParallel"
        assert out["synced"] == [True]  # the one BatchNorm1d became a SyncBatchNorm
        assert finite(out["losses"])
    # The ranks saw different data: equal running statistics mean they came from the global batch.
    assert torch.allclose(runs[0]["running_mean"], runs[1]["running_mean"], atol=1e-6)
    assert runs[0]["running_mean"].abs().max() > 0


@two_gpus
@bf16
def test_sync_bn_under_fsdp2_bf16_is_its_own_unit_and_trains(tmp_path):
    runs = run_parallel("tests.gpu.workers:sync_bn_run", "fsdp2", "bf16", backend="nccl", nproc=2,
                        tmp_path=tmp_path, timeout=180)
    for out in runs.values():
        assert out["synced"] == [True]  # the one BatchNorm1d became a SyncBatchNorm
        assert out["report"]["wrapper"] == "fsdp2"
        assert out["report"]["units"] == ["<root>", "1"]  # Sequential index 1 is the BatchNorm
        assert out["running_mean"].dtype == torch.float32  # kept in fp32, as FSDP2 keeps that unit
        assert finite(out["losses"])
    assert torch.allclose(runs[0]["running_mean"], runs[1]["running_mean"], atol=1e-6)


@pytest.mark.parametrize("nproc", ONE_AND_TWO_GPUS)
def test_built_on_meta_and_sharded_on_gpus_the_full_parameters_are_the_cpu_whole_builds(nproc, tmp_path):
    """model.init_device=meta under nccl: the replay draws on the CPU (the generator the whole build drew from) and
    each GPU keeps its slice."""
    out = run_parallel("tests.parallel.test_meta_init:sharded_from_meta", "gpt", ["fsdp2", "fsdp"], backend="nccl",
                       nproc=nproc, tmp_path=tmp_path, timeout=240)
    for rank in range(nproc):
        for wrap, seen in out[rank].items():
            assert seen == {"wrapper": wrap, "init_device": "meta", "keys_match": True, "differ": []}, (rank, wrap)
