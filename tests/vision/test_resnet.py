"""torchvision's ResNet-18 from config (``model=resnet18``), with its BatchNorm layers under FSDP.

torchvision must be the build made for the installed torch. The main venv's CPU torch 2.13.0 has no matching wheel
in the registry, so ``bash scripts/dev.sh test`` runs this folder in a second venv (torch 2.14.1 + torchvision
0.29.1, which run on the CPU); in the main venv it is skipped, saying so.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.spawn import NO_PLAN, job_dirs, run_cli, run_parallel

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

try:
    from hydraddp.models.vision import _torchvision

    _torchvision()
except ImportError as exc:
    pytest.skip(f"no torchvision that loads beside this torch ({exc.__class__.__name__}); scripts/dev.sh test "
                "runs these tests in a venv of its own", allow_module_level=True)


def test_resnet18_trains_under_fsdp(tmp_path):
    done = run_cli("model=resnet18", "wrap=fsdp", "trainer.max_steps=30", "trainer.log_every=10", NO_PLAN,
                   "trainer.eval_every=0", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    [job] = job_dirs(tmp_path)
    result = json.loads((job / "result.json").read_text())
    assert result["world_size"] == 2 and all(r["wrapper"] == "fsdp" for r in result["reports"])
    assert result["losses"]["30"] < result["losses"]["10"]
    assert result["eval_metrics"]["accuracy"] > 0.5  # ten classes: chance is 0.1
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["hydraddp.model_class"] == "torchvision.models.resnet.ResNet"


def test_under_bf16_batchnorm_computes_in_fp32_in_units_of_its_own_and_convolutions_in_bf16(tmp_path):
    out = run_parallel("tests.vision.workers:compute_dtypes", ["fsdp", "fsdp2"], tmp_path=tmp_path, timeout=300)
    for rank in (0, 1):
        for wrap in ("fsdp", "fsdp2"):
            seen = out[rank][wrap]
            assert seen["dtypes"] == {"batchnorm": ["float32"], "conv": ["bfloat16"]}, (wrap, seen)
            assert "bn1" in seen["units"] and "layer1.0.bn1" in seen["units"], (wrap, seen["units"])
            assert seen["loss"] == seen["loss"]  # not NaN
