"""``hydra/sweeper=hydraddp_optuna``: real optuna, real 2-rank gloo launches, the suite's real `mlflow server`.

Each trial is a launch; the study lives in a SQLite file the tests read back with optuna itself."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hydraddp.tracking import names
from tests.helpers.spawn import assert_no_orphans, child_env, run_cli
from tests.tracking.test_mlflow import runs_of, tracked

optuna = pytest.importorskip("optuna")

SEARCH = ["-m", "hydra/sweeper=hydraddp_optuna", "launcher.nproc_per_node=2"]
LR = "optim.optimizer.lr"
QUICK = ["trainer.max_steps=20", "trainer.eval_every=5", "trainer.log_every=5", "tracking.model.enabled=false"]


def study(path: Path, name: str):
    """The study, read as a sweeper would: under the lease its sweeper creates the file's tables with (opening a
    fresh file while they are made races their creation)."""
    from hydraddp.search.sweeper import _creating

    with _creating(f"sqlite:///{path}"):
        return optuna.load_study(study_name=name, storage=f"sqlite:///{path}")


def rank_values(job_dir: Path) -> dict[int, str]:
    """rank -> the searched values that rank's log says it trained with."""
    found = {}
    for log in sorted(job_dir.glob("logs/rank*.log")):
        match = re.search(r"search trial \d+: (.*)$", log.read_text(), re.M)
        found[int(log.stem.removeprefix("rank"))] = match[1] if match else None
    return found


@pytest.mark.slow
def test_the_issues_search_ends_with_8_trials_each_a_child_run_with_its_trials_lr(mlflow_server, tmp_path):
    experiment = f"search-{uuid.uuid4().hex[:6]}"
    done = run_cli(*SEARCH, "hydra.sweeper.n_trials=8", "hydra.sweeper.n_jobs=2", "hydra.sweeper.storage=sqlite:///study.db",
                   "hydra.sweeper.study_name=lr", "hydra.sweeper.pruner=median", f"{LR}=tag(log, interval(1e-5, 1e-1))",
                   "trainer.max_steps=40", "trainer.eval_every=10", "tracking.model.enabled=false",
                   *tracked(mlflow_server, experiment), cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = study(tmp_path / "study.db", "lr").get_trials()
    assert len(trials) == 8 and {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}, [t.state for t in trials]
    runs = runs_of(mlflow_server, experiment)
    [parent] = [r for r in runs if names.TAG_SWEEP in r.data.tags]
    children = {int(r.data.tags["hydraddp.trial"]): r for r in runs if names.TAG_SWEEP not in r.data.tags}
    assert sorted(children) == list(range(8))
    for trial in trials:
        child = children[trial.number]
        assert float(child.data.params[LR]) == trial.params[LR]
        assert child.data.tags["hydraddp.trial_state"] == trial.state.name
        assert child.data.tags[names.TAG_PARENT] == parent.info.run_id
        # Every rank trained with the trial's value (each rank's log, from its own config).
        job_dir = Path(child.data.tags[names.TAG_JOB_DIR])
        assert rank_values(job_dir) == {0: f"{LR}={trial.params[LR]!r}", 1: f"{LR}={trial.params[LR]!r}"}
    best = min((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert parent.data.params[f"search/best/{LR}"] == str(best.params[LR])
    assert parent.data.tags["hydraddp.best_trial_run"] == children[best.number].info.run_id
    artifacts = {a.path for a in mlflow_server.client().list_artifacts(parent.info.run_id, "search")}
    assert "search/optimization_history.png" in artifacts


@pytest.mark.slow
def test_a_pruned_trial_stops_every_rank_at_the_same_step(mlflow_server, tmp_path):
    """Two good trials first (enqueued), then a learning rate that cannot learn: the median pruner stops it at its
    first evaluation, on both ranks at the step they agree on."""
    storage = tmp_path / "study.db"
    created = optuna.create_study(study_name="prune", storage=f"sqlite:///{storage}")
    for lr in (0.1, 0.1, 1e-7):
        created.enqueue_trial({LR: lr})
    experiment = f"prune-{uuid.uuid4().hex[:6]}"
    done = run_cli(*SEARCH, "hydra.sweeper.n_trials=3", f"hydra.sweeper.storage=sqlite:///{storage}",
                   "hydra.sweeper.study_name=prune", "hydra.sweeper.pruner=median", f"{LR}=choice(0.1, 1e-7)", *QUICK,
                   *tracked(mlflow_server, experiment), cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = study(storage, "prune").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    runs = {int(r.data.tags["hydraddp.trial"]): r for r in runs_of(mlflow_server, experiment)
            if "hydraddp.trial" in r.data.tags}
    pruned = runs[2]
    assert pruned.info.status == "FINISHED" and pruned.data.tags["hydraddp.pruned"] == "true"
    step = int(pruned.data.tags["hydraddp.pruned_step"])
    assert 5 <= step < 20  # after the first evaluation, long before the end
    logs = [p.read_text() for p in sorted(Path(pruned.data.tags[names.TAG_JOB_DIR]).glob("logs/rank*.log"))]
    assert len(logs) == 2 and all(f"stopping after step {step}" in log for log in logs)


def test_a_bad_search_space_is_exit_2_naming_it(tmp_path):
    for bad, said in ((f"{LR}=tag(log, interval(0, 0.1))", f"{LR}=tag(log, interval(0, 0.1))"),
                      ("optim.optimizer.lrr=interval(1e-5, 1e-1)", "optim.optimizer.lrr"),
                      (f"{LR}=tag(cube, interval(1e-5, 1e-1))", "tag cube")):
        done = run_cli(*SEARCH, bad, "tracking.enabled=false", cwd=tmp_path, timeout=120)
        assert done.returncode == 2, (bad, done.stderr[-2000:])
        assert "invalid search; no trial was started" in done.stderr and said in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
    done = run_cli(*SEARCH, f"{LR}=interval(1e-5, 1e-1)", "hydra.sweeper.pruner=bogus", "tracking.enabled=false",
                   cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "hydra.sweeper.pruner=bogus" in done.stderr
    assert not (tmp_path / "optuna.db").exists()  # nothing was started


def _sweeper(tmp_path: Path, token: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hydraddp", *SEARCH, f"{LR}=tag(log, interval(1e-4, 1e-1))",
                             "hydra.sweeper.storage=sqlite:///shared.db", "hydra.sweeper.study_name=shared",
                             "tracking.enabled=false", *QUICK, *args], cwd=tmp_path, env=child_env(token),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_two_sweepers_share_one_study(tmp_path):
    token = uuid.uuid4().hex
    first, second = (_sweeper(tmp_path, token, "hydra.sweeper.n_trials=4", f"hydra.sweep.dir=sweep{i}")
                     for i in (0, 1))
    outputs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], [o[-2000:] for o in outputs]
    assert_no_orphans(token)
    trials = study(tmp_path / "shared.db", "shared").get_trials()
    owners = {t.system_attrs["hydraddp_owner"]["pid"] for t in trials}
    assert owners == {first.pid, second.pid}  # both sweepers ran trials of the one study
    # Each stops asking once the study holds n_trials: together 4, or 5 when both asked for the fourth at once.
    assert 4 <= len(trials) <= 5 and all(t.state.name == "COMPLETE" for t in trials)


@pytest.mark.slow
def test_a_killed_sweepers_study_resumes_and_its_running_trial_is_failed(tmp_path):
    token = uuid.uuid4().hex
    killed = _sweeper(tmp_path, token, "hydra.sweeper.n_trials=2", "trainer.max_steps=400")
    deadline = time.monotonic() + 180
    while True:  # until its first trial is running
        assert time.monotonic() < deadline and killed.poll() is None, killed.stdout.read()[-3000:]
        if (tmp_path / "shared.db").exists():
            running = [t for t in study(tmp_path / "shared.db", "shared").get_trials()
                       if t.state.name == "RUNNING"]
            if running:
                break
        time.sleep(0.5)
    time.sleep(3)  # inside its launch
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert_no_orphans(token, grace_s=30)
    again = _sweeper(tmp_path, token, "hydra.sweeper.n_trials=2")
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out[-3000:]
    assert "trial 0 was running when its sweeper died: marked FAIL" in out
    states = [t.state.name for t in study(tmp_path / "shared.db", "shared").get_trials()]
    assert states == ["FAIL", "COMPLETE", "COMPLETE"]
