"""``launcher.nproc_per_node=auto`` (the default): one rank per visible GPU under nccl, as torchrun's
``--nproc-per-node=gpu``, so that the headline command uses the node as written; today's 2 without a GPU. GPUs are
what this machine cannot have: the driver's GPU list and a CUDA build of torch are stood in for, nothing else."""

import importlib.metadata

import pytest

from hydraddp.config.compose import compose
from hydraddp.parallel import machine
from hydraddp.preflight import config_problems
from hydraddp.preflight import config as preflight_config
from hydraddp.preflight import settings as preflight_settings
from tests.helpers.spawn import run_cli

HEADLINE = ["backend=nccl", "wrap=fsdp2", "precision=bf16"]


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """``gpus(n)``: this node's NVIDIA driver lists ``n`` GPUs (its /proc folder), under a CUDA build of torch; the
    real ``cuda_device_count`` narrows them by ``CUDA_VISIBLE_DEVICES``."""
    real_version, real_count = importlib.metadata.version, machine.cuda_device_count

    def node_with(count: int) -> None:
        listed = tmp_path / f"nvidia-gpus-{count}"
        for index in range(count):
            (listed / f"0000:{index:02x}:00.0").mkdir(parents=True)
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name: "2.11.0+cu130" if name == "torch" else real_version(name))
        counted = lambda env=None: real_count(env, gpus_dir=listed)  # noqa: E731
        monkeypatch.setattr(machine, "cuda_device_count", counted)
        monkeypatch.setattr(preflight_settings, "cuda_device_count", counted)

    return node_with


@pytest.mark.parametrize("count, visible, expected", [(1, None, 1), (8, None, 8), (8, "0,1,2,3", 4), (8, "5", 1)])
def test_auto_is_one_rank_per_visible_gpu_under_nccl(gpus, monkeypatch, count, visible, expected):
    gpus(count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    for backend in ("nccl", "auto"):  # backend=auto picks nccl with GPUs
        cfg = compose([f"backend={backend}", "wrap=fsdp2", "precision=bf16"])
        assert cfg.launcher.nproc_per_node == "auto"  # the default
        preflight_settings.complete(cfg)
        assert (cfg.backend.name, cfg.launcher.nproc_per_node) == ("nccl", expected)
        assert not [p for p in preflight_config.problems(cfg) if "launcher.nproc_per_node" in p.keys]


def test_auto_without_a_gpu_is_two_processes_one_under_backend_none_and_gloo_keeps_two_on_a_gpu_node(gpus):
    for backend, expected in (("gloo", 2), ("auto", 2), ("none", 1)):
        cfg = compose([f"backend={backend}"])
        preflight_settings.complete(cfg)
        assert cfg.launcher.nproc_per_node == expected, backend
    gpus(8)
    cfg = compose(["backend=gloo"])
    preflight_settings.complete(cfg)
    assert cfg.launcher.nproc_per_node == 2  # gloo on CPU tensors: not one per GPU


def test_a_number_given_is_kept_and_nccl_past_the_gpus_names_auto(gpus):
    gpus(1)
    cfg = compose([*HEADLINE, "launcher.nproc_per_node=2"])
    [problem] = [p for p in config_problems(cfg, []) if "launcher.nproc_per_node" in p.keys]
    assert "launcher.nproc_per_node=2 and this node has 1 GPU(s)" in str(problem)
    assert "Set launcher.nproc_per_node=1 (or fewer), or auto (one per GPU)." in str(problem)


def test_the_headline_command_runs_as_written_on_this_cpu_machine_with_the_cpu_rule(tmp_path):
    """Without a GPU the rule gives gloo's 2 ranks (backend=auto): the default experiment runs as the README says."""
    done = run_cli("wrap=fsdp2", "trainer.max_steps=2", "trainer.eval_every=0", "tracking.enabled=false",
                   cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps at world size 2" in done.stdout + done.stderr
