"""Misuse of the core fails with a clear error that names the value and the fix."""

import pytest

from hydraddp.distributed import ConfigurationError, Parallel, initialize


@pytest.fixture(scope="module")
def errors(pools):
    return pools.run("tests.distributed.workers:error_cases")[0]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("offload", "offload=cpu moves FSDP parameters between an accelerator and the CPU"),
        ("fp16", "precision=fp16 needs CUDA"),
        ("dp_with_process_group", "wrap=dp is single-process DataParallel, but world_size=2 processes run"),
        ("unknown_wrap", "wrap=zero3 is not an option"),
        # DDP itself refuses SyncBatchNorm on CPU ("only work with GPU modules"); we say so before, with the fix.
        ("sync_bn_on_cpu", "sync_bn=true needs GPUs"),
        ("optimizer_before_fsdp", "Create the optimizer after wrapping"),
        ("optimizer_before_fsdp2", "Create the optimizer after wrapping"),
    ],
)
def test_misuse_in_a_real_process_group_is_refused(errors, case, expected):
    assert expected in errors[case]


def test_the_fix_is_part_of_the_message(errors):
    assert "Set offload=none" in errors["offload"]
    assert "Use precision=bf16 (or fp32) on CPU" in errors["fp16"]


def test_nccl_on_a_cpu_machine_is_refused_before_any_worker_starts():
    with pytest.raises(ConfigurationError, match="backend=nccl needs CUDA GPUs.*Use backend=gloo"):
        Parallel(backend="nccl", nproc_per_node=2)
    with pytest.raises(ConfigurationError, match="backend=nccl needs CUDA GPUs"):
        initialize("nccl")


def test_unknown_backend():
    # What this torch has: ('gloo',), with Horovod ('gloo', 'horovod'), a CUDA build ('nccl', 'gloo').
    with pytest.raises(ValueError, match=r"Backend should be one of '\(.*'gloo'.*\)', but given 'tpu'"):
        initialize("tpu")
    with pytest.raises(ValueError, match=r"Unknown backend 'tpu'. Available backends: \(.*'gloo'"):
        Parallel(backend="tpu")
