"""The package works installed from a built wheel: the configs and experiments travel inside it."""

import subprocess
import sys

import pytest
import yaml

from tests.helpers.spawn import REPO

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md


def test_installed_wheel_composes_the_config(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(REPO)],
                   check=True, capture_output=True)
    [wheel] = (tmp_path / "dist").glob("hydraddp-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # --cfg job needs Hydra only (torch loads when a run starts), which keeps this fresh venv small.
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, capture_output=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "hydra-core>=1.3,<1.4"], check=True, capture_output=True)
    work = tmp_path / "elsewhere"  # not the repository: nothing may come from the source tree
    work.mkdir()
    done = subprocess.run([python, "-m", "hydraddp", "experiment=gpt_fsdp2", "--cfg", "job"], cwd=work,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert (printed["wrap"]["name"], printed["model"]["_target_"]) == ("fsdp2", "hydraddp.models.gpt.GPT")
    # The search's sweeper travels too, where Hydra finds plugins (hydra_plugins/).
    done = subprocess.run([python, "-m", "hydraddp", "hydra/sweeper=hydraddp_optuna", "--cfg", "hydra"], cwd=work,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    sweeper = yaml.safe_load(done.stdout)["hydra"]["sweeper"]
    assert sweeper["_target_"].startswith("hydra_plugins.hydraddp_optuna_sweeper.") and sweeper["metric"] == "eval/loss"
    located = subprocess.run([python, "-c", "import hydraddp; print(hydraddp.__file__)"], cwd=work,
                             capture_output=True, text=True, check=True).stdout
    assert str(venv) in located
