"""Secrets never reach MLflow: a value under a secret key at any depth (in lists too), a URI's password, a value from
``${oc.env:...}``, and a sweep's overrides are searched for byte for byte in the server's backend store and
every artifact it holds, and in every checkpoint. Hydra's own .hydra/ files keep them, as Hydra writes them."""

import uuid
from pathlib import Path

import pytest

from tests.helpers.spawn import NO_MODEL, job_dirs, run_cli

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

QUICK = ["trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=0"]


def files_holding(root: Path, secret: str) -> list[Path]:
    needle = secret.encode()
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_secrets_are_nowhere_in_mlflow_nor_in_checkpoints(mlflow_server, tmp_path):
    experiment = f"secrets-{uuid.uuid4().hex[:6]}"
    typed, from_env, swept, listed, in_uri = (f"{kind}-{uuid.uuid4().hex}"
                                              for kind in ("typed", "env", "swept", "listed", "uri"))
    tracked = [f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={experiment}", NO_MODEL]
    single = run_cli(f"+trainer.secrets.db={typed}", "+trainer.note=${oc.env:HYDRADDP_TEST_SECRET}",
                     f"+trainer.hooks=[{{name: notify, api_key: {listed}}}]",  # a secret inside a list
                     f'+trainer.results_db="postgresql://me:{in_uri}@db:5432/results"',  # a password in a URI
                     "checkpoint.save_last=true", *QUICK, *tracked, cwd=tmp_path / "single",
                     env={"HYDRADDP_TEST_SECRET": from_env})
    assert single.returncode == 0, single.stderr[-3000:]
    sweep = run_cli("-m", f"+trainer.credentials.key={swept},{swept}-2", "wrap=ddp", *QUICK, *tracked,
                    cwd=tmp_path / "sweep", timeout=300)
    assert sweep.returncode == 0, sweep.stderr[-3000:]

    client = mlflow_server.client()
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 4  # the single run, the sweep's parent and its two children
    [job] = job_dirs(tmp_path / "single")
    assert [p.name for p in (job / "checkpoints").iterdir()] == ["step_00000006"]
    for secret in (typed, from_env, swept, listed, in_uri):
        seen = " ".join(f"{r.info.run_name} {r.data.params} {r.data.tags}" for r in runs)
        assert secret not in seen
        assert files_holding(mlflow_server.root, secret) == []  # the backend store and every artifact
        assert files_holding(job / "checkpoints", secret) == []
    assert typed in (job / ".hydra" / "overrides.yaml").read_text()  # Hydra's own files stay as Hydra wrote them
    params = next(r for r in runs if r.info.run_id == (job / "mlflow_run_id").read_text().strip()).data.params
    assert params["trainer.results_db"] == "postgresql://me:***@db:5432/results"  # the rest of the URI kept
    assert params["trainer.hooks"] == str([{"name": "notify", "api_key": "***redacted***"}])
