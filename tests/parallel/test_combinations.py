"""The compatibility rules: every problem listed, each naming its keys, values and fix."""

import pytest

from hydraddp.distributed import Combination, ConfigurationError, check_compatibility, resolve_wrap


def problems(**fields):
    return check_compatibility(Combination(**fields))


def only(**fields):
    found = problems(**fields)
    assert len(found) == 1, found
    return found[0]


def test_a_good_cpu_combination_has_no_problem():
    assert problems(backend="gloo", wrap="fsdp2", precision="bf16", world_size=2, global_batch_size=64) == []


def test_srun_tasks_that_each_see_their_own_gpu_are_one_process_per_gpu():
    # srun --ntasks-per-node=4 --gpus-per-task=1: each task sees 1 GPU, 4 tasks on the node.
    assert problems(backend="nccl", world_size=8, nproc_per_node=4, cuda_device_count=1, attached=True) == []
    p = only(backend="nccl", world_size=8, nproc_per_node=4, cuda_device_count=1)  # spawned here: 4 on 1 GPU
    assert "runs one process per GPU" in p.message and "nproc_per_node=1" in p.fix


def test_nccl_without_cuda():
    p = only(backend="nccl", world_size=2)
    assert p.keys == ("backend",) and "backend=nccl needs CUDA" in p.message and "backend=gloo" in p.fix


def test_offload_on_cpu_and_with_the_wrong_wrap_are_both_listed():
    found = problems(backend="gloo", wrap="ddp", offload="cpu", world_size=2)
    assert [p.keys for p in found] == [("offload", "wrap"), ("offload",)]
    assert "offload=cpu only applies to FSDP, but wrap=ddp" in found[0].message
    assert "Cannot access accelerator device" in found[1].message and "offload=none" in found[1].fix


def test_offload_with_fsdp_on_a_gpu_machine_is_fine():
    assert problems(backend="nccl", wrap="fsdp2", offload="cpu", world_size=2, cuda_device_count=2) == []


def test_fp16_on_cpu():
    p = only(backend="gloo", precision="fp16", world_size=2)
    assert p.keys == ("precision",) and "precision=bf16" in p.fix


def test_bf16_on_a_gpu_without_bf16():
    p = only(backend="nccl", precision="bf16", world_size=1, cuda_device_count=1, bf16_supported=False)
    assert "needs bf16 support" in p.message


def test_dp_with_several_processes():
    p = only(backend="nccl", wrap="dp", world_size=2, cuda_device_count=2)
    assert p.keys == ("wrap", "world_size") and "wrap=ddp" in p.fix


@pytest.mark.parametrize("wrap", ["fsdp", "fsdp2", "dp"])
def test_fsdp_and_dp_under_horovod(wrap):
    found = problems(backend="horovod", wrap=wrap, world_size=2, has_horovod=True, cuda_device_count=2)
    assert any(p.keys == ("backend", "wrap") and f"wrap={wrap} cannot run under backend=horovod" in p.message
               for p in found), found


def test_missing_horovod_names_the_install_command():
    p = only(backend="horovod", world_size=2, has_horovod=False)
    assert "scripts/install_horovod.sh" in p.fix


def test_backend_none_with_several_processes_uses_config_names():
    p = only(backend="none", wrap="none", world_size=2, names={"world_size": "launcher.nproc_per_node"})
    assert p.keys == ("backend", "launcher.nproc_per_node")
    assert "launcher.nproc_per_node=2" in p.message


@pytest.mark.parametrize("wrap", ["ddp", "fsdp", "fsdp2"])
def test_sharded_or_ddp_wraps_need_a_process_group(wrap):
    p = only(backend="none", wrap=wrap)
    assert f"wrap={wrap} needs a process group" in p.message


def test_uneven_batch_split_shows_the_division_and_a_fix():
    p = only(backend="gloo", world_size=4, global_batch_size=30, names={"batch_size": "data.batch_size"})
    assert "data.batch_size=30" in p.message and "30 / 4 = 7.5" in p.message and "data.batch_size=32" in p.fix


def test_sync_bn_needs_gpus_and_never_works_with_dp():
    p = only(backend="gloo", wrap="ddp", sync_bn=True, world_size=2, names={"sync_bn": "model.sync_bn"})
    assert "SyncBatchNorm layers only work with GPU modules" in p.message and "model.sync_bn=false" in p.fix
    assert problems(backend="nccl", wrap="fsdp2", sync_bn=True, world_size=2, cuda_device_count=2) == []
    found = problems(backend="none", wrap="dp", sync_bn=True, cuda_device_count=2)
    assert [p.message for p in found] == [
        "sync_bn=true does not work with wrap=dp: SyncBatchNorm needs one process per device."]


def test_unknown_option_lists_the_valid_ones():
    p = only(backend="gloo", wrap="zero3")
    assert p.keys == ("wrap",) and "fsdp2" in p.fix


def test_configuration_error_lists_every_problem():
    found = problems(backend="nccl", wrap="dp", offload="cpu", precision="fp16", world_size=2)
    err = ConfigurationError(found)
    assert len(str(err).splitlines()) == len(found) >= 4
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    "fields, wrap",
    [
        (dict(backend="gloo", world_size=2), "ddp"),
        (dict(backend="nccl", world_size=2, cuda_device_count=2), "ddp"),
        (dict(backend="horovod", world_size=2), "horovod"),
        (dict(backend="horovod", wrap="ddp", world_size=2), "horovod"),
        (dict(backend="none", cuda_device_count=2), "dp"),
        (dict(backend="none", cuda_device_count=1), "none"),
        (dict(backend="gloo", world_size=1), "none"),
        (dict(backend="gloo", wrap="fsdp2", world_size=2), "fsdp2"),
    ],
)
def test_resolve_wrap_follows_ignite(fields, wrap):
    assert resolve_wrap(Combination(**fields)) == wrap


def test_nccl_with_more_processes_than_gpus():
    p = only(backend="nccl", world_size=4, nproc_per_node=4, cuda_device_count=2,
             names={"nproc_per_node": "launcher.nproc_per_node"})
    assert "one process per GPU" in p.message and "launcher.nproc_per_node=2" in p.fix
    assert problems(backend="nccl", world_size=4, nproc_per_node=2, cuda_device_count=2) == []
