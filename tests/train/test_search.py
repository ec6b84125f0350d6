"""``hydra/sweeper=hydraddp_optuna``: real optuna, real 2-rank gloo launches, the suite's real `mlflow server`.

Each trial is a launch; the study lives in a SQLite file the tests read back with optuna itself."""

import importlib.util
import json
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
from tests.helpers.spawn import REPO, assert_no_orphans, child_env, run_cli, run_process
from tests.tracking.test_mlflow import runs_of, tracked

optuna = pytest.importorskip("optuna")

SEARCH = ["-m", "hydra/sweeper=hydraddp_optuna", "launcher.nproc_per_node=2"]
LR = "optim.optimizer.lr"
QUICK = ["trainer.max_steps=20", "trainer.eval_every=5", "trainer.log_every=5", "tracking.model.enabled=false"]


def study(path: Path, name: str):
    """The study, read as a sweeper would: under the lease its sweeper creates the file's tables with (opening a
    fresh file while they are made races their creation)."""
    from hydraddp.search.storage import creating

    with creating(f"sqlite:///{path}"):
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
                   "trainer.max_steps=20", "trainer.eval_every=5", "tracking.model.enabled=false",
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


def _sweeper(tmp_path: Path, token: str, *args: str, storage: str = "sqlite:///shared.db",
             host: str | None = None) -> subprocess.Popen:
    """A sweeper of the study "shared"; on ``host``, a host name of its own (a UTS namespace: root only)."""
    command = [sys.executable, "-m", "hydraddp", *SEARCH, f"{LR}=tag(log, interval(1e-4, 1e-1))",
               f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=shared", "tracking.enabled=false", *QUICK,
               *args]
    if host is not None:
        command = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]
    return subprocess.Popen(command, cwd=tmp_path, env=child_env(token), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _trials(storage: str):
    from hydraddp.handoff.trial import journal_path, open_storage

    if journal_path(storage) is None:
        return study(Path(storage.removeprefix("sqlite:///")), "shared").get_trials()
    return optuna.load_study(study_name="shared", storage=open_storage(storage)).get_trials()


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


# A sweeper killed on this host is seen dead at once (its pid); one on another host, or whose host was lost, only
# by the heartbeat it no longer records: optuna's for a database, a trial attribute for a journal.
KILLED = [("this host", "sqlite:///{tmp}/shared.db", "trial 0 was running when its sweeper died: marked FAIL"),
          ("another host", "sqlite:///{tmp}/shared.db", "trial 0 had no heartbeat for the grace period: marked FAIL"),
          ("another host", "journal:///{tmp}/shared.journal",
           "trial 0 had no heartbeat for the grace period: marked FAIL")]


@pytest.mark.slow
@pytest.mark.parametrize("where, storage, said", KILLED, ids=["this-host", "other-host-sqlite", "other-host-journal"])
def test_a_killed_sweepers_study_resumes_and_its_running_trial_is_failed(tmp_path, where, storage, said):
    if where != "this host" and os.geteuid() != 0:
        pytest.skip("another host name needs root (a UTS namespace)")
    storage = storage.format(tmp=tmp_path)
    token = uuid.uuid4().hex
    killed = _sweeper(tmp_path, token, "hydra.sweeper.n_trials=2", "trainer.max_steps=400", storage=storage,
                      host=None if where == "this host" else "elsewhere")
    deadline = time.monotonic() + 180
    while not list(tmp_path.glob("multirun/*/*/trial-0/logs/rank0.log")):  # until its first trial trains
        assert time.monotonic() < deadline and killed.poll() is None, killed.stdout.read()[-3000:]
        time.sleep(0.5)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert_no_orphans(token, grace_s=30)
    again = _sweeper(tmp_path, token, "hydra.sweeper.n_trials=2", "hydra.sweeper.heartbeat_interval=1",
                     "hydra.sweeper.grace_period=4", storage=storage)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out[-3000:]
    assert said in out, out[-3000:]
    assert [t.state.name for t in _trials(storage)] == ["FAIL", "COMPLETE", "COMPLETE"]


def _user_package(root: Path, extra: str = "") -> dict[str, str]:
    """The README's own package and config dir (tests/test_your_own_package.py) under ``root``; its PYTHONPATH."""
    import textwrap

    from tests.test_your_own_package import PACKAGE

    for path, text in PACKAGE.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text) + (textwrap.dedent(extra) if path == "mypkg/parts.py" else ""))
    return {"PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}


@pytest.mark.slow
def test_a_search_with_a_users_config_dir_runs_every_trial_as_its_launch_on_gpus_of_its_own(tmp_path):
    """The README's ``--config-dir myconf model=tiny`` pattern under the search: every trial is the sweeper's launch
    (its config dir, and its hydra.* overrides but its own) with the trial's values. Two at a time on four GPUs (the
    driver's listing, faked: root only), each gets two of its own."""
    env = _user_package(tmp_path / "user")
    search = ["--config-dir", str(tmp_path / "user" / "myconf"), *SEARCH[:2], "launcher.nproc_per_node=auto",
              "model=tiny", "data=blobs", "task=hinge", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
              "hydra.job.name=mine", "hydra.sweep.dir=sweep", f"{LR}=tag(log, interval(1e-3, 1e-1))",
              "tracking.enabled=false", *QUICK]
    done = run_process(_with_fake_gpus(sys.executable, "-m", "hydraddp", *search), cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = study(tmp_path / "optuna.db", re.search(r"study '(\S+)'", done.stdout)[1]).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    devices = []
    for number in (0, 1):
        job = tmp_path / "sweep" / f"trial-{number}"
        assert "_target_: mypkg.parts.TinyNet" in (job / ".hydra" / "config.yaml").read_text()
        hydra = (job / ".hydra" / "hydra.yaml").read_text()
        assert "- hydra.job.name=mine" in hydra and "hydra.sweeper" not in hydra  # carried, the sweeper's own not
        # Each rank of the trial saw its two GPUs (its own log, from its own environment).
        [seen] = set(rank_values(job).values())
        devices.append(re.search(r"CUDA_VISIBLE_DEVICES=(\S+)\)", seen)[1])
    assert sorted(devices) == ["0,1", "2,3"]


@pytest.mark.slow
def test_a_search_whose_every_trial_failed_exits_1_with_its_parent_failed(mlflow_server, tmp_path):
    env = _user_package(tmp_path / "user", '''

        class Broken(TinyNet):
            def forward(self, points):
                raise RuntimeError("broken on purpose")
    ''')
    experiment = f"failed-{uuid.uuid4().hex[:6]}"
    done = run_cli("--config-dir", str(tmp_path / "user" / "myconf"), *SEARCH, "model=tiny",
                   "model._target_=mypkg.parts.Broken", "model.width=16", "data=blobs", "task=hinge",
                   "hydra.sweeper.n_trials=2", f"{LR}=tag(log, interval(1e-3, 1e-1))", *QUICK,
                   *tracked(mlflow_server, experiment), cwd=tmp_path / "run", env=env, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every trial failed (2 of 2)" in done.stdout
    table = done.stdout[done.stdout.index("\nhydraddp search: study "):done.stdout.index("no trial completed")]
    failures = re.findall(r"rank \d failed: RuntimeError: broken on purpose", table)
    assert table.count(" FAIL ") == 2 and len(failures) == 2, table
    [parent] = [r for r in runs_of(mlflow_server, experiment) if names.TAG_SWEEP in r.data.tags]
    assert parent.info.status == "FAILED"


# Four GPUs, as the NVIDIA driver lists them in /proc, in a mount namespace of the sweeper's own (root only). /proc
# is made private there first (unshare cannot change the propagation of / in a chroot, where / is no mount point).
FAKE_GPUS = ("mount --make-rprivate /proc && mount -t tmpfs none /proc/driver && for bus in 01 02 03 04; do "
             "mkdir -p /proc/driver/nvidia/gpus/0000:$bus:00.0; done && exec \"$@\"")


def _with_fake_gpus(*command: str) -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("faking the GPU listing needs root (a mount namespace)")
    return ["unshare", "--mount", "--propagation", "unchanged", "sh", "-c", FAKE_GPUS, "sh", *command]


def test_more_trials_at_once_than_gpus_is_exit_2_before_any_trial(tmp_path):

    command = _with_fake_gpus(sys.executable, "-m", "hydraddp", *SEARCH[:2], "launcher.nproc_per_node=2",
                              "hydra.sweeper.n_jobs=3", f"{LR}=choice(0.01, 0.02)", "tracking.enabled=false")
    done = run_process(command, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("hydra.sweeper.n_jobs=3 trials at a time of launcher.nproc_per_node=2 need 6 GPUs, and 4 are visible "
            "here (0,1,2,3): lower hydra.sweeper.n_jobs to 2") in done.stderr, done.stderr
    assert not (tmp_path / "optuna.db").exists()


def test_a_sqlite_study_for_trials_on_other_machines_is_exit_2(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra: pip install 'hydraddp[slurm]'")
    done = run_cli(*SEARCH[:2], "hydra/launcher=slurm", "launcher.nproc_per_node=2", f"{LR}=choice(0.01, 0.02)",
                   "tracking.uri=http://mlflow:5000", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "hydra.sweeper.storage=sqlite:///" in done.stderr and "postgresql://" in done.stderr, done.stderr
    assert not (tmp_path / "optuna.db").exists()


def test_gpu_slots_split_the_visible_gpus_between_the_trials_running_at_once(tmp_path):
    from hydraddp.config.compose import compose
    from hydraddp.search.launch import gpu_slots

    listing = tmp_path / "gpus"
    for bus in range(8):
        (listing / f"0000:0{bus}:00.0").mkdir(parents=True)

    def slots(n_jobs: int, *overrides: str, visible: str | None = None):
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        return gpu_slots(compose(list(overrides), return_hydra_config=True), n_jobs, env, listing)

    assert slots(4, "launcher.nproc_per_node=auto") == (["0,1", "2,3", "4,5", "6,7"], [])
    assert slots(3, "launcher.nproc_per_node=auto") == (["0,1", "2,3", "4,5"], [])
    assert slots(2, "launcher.nproc_per_node=1", "backend=nccl", visible="5,7,2") == (["5", "7"], [])
    assert slots(2, "backend=gloo") == ([], [])  # a backend that does not use them: nothing to split
    no_driver = tmp_path / "none"
    assert gpu_slots(compose(["launcher.nproc_per_node=2"], return_hydra_config=True), 2, {}, no_driver) == ([], [])
    [problem] = slots(3, "launcher.nproc_per_node=2", visible="0,1,2,3")[1]
    assert "hydra.sweeper.n_jobs=3 trials at a time of launcher.nproc_per_node=2 need 6 GPUs, and 4 are" in problem
    assert slots(9, "launcher.nproc_per_node=auto")[1]  # fewer GPUs than trials: not even one each


SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler", "cmaes": "CmaEsSampler", "nsgaii": "NSGAIISampler",
            "grid": "GridSampler", "qmc": "QMCSampler", "gp": "GPSampler"}


def _search_of(*overrides: str):
    from hydra_plugins.hydraddp_optuna_sweeper.sweeper import HydraddpOptunaSweeper

    from hydraddp.config.compose import compose

    settings = compose(["hydra/sweeper=hydraddp_optuna", *overrides], return_hydra_config=True).hydra.sweeper
    return HydraddpOptunaSweeper(**{k: v for k, v in settings.items() if not k.startswith("_")})


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_each_sampler_group_is_optunas_sampler_with_its_settings(name):
    """``hydra/sweeper/sampler=NAME`` (hydra-optuna-sweeper's groups) makes optuna's sampler with the settings given;
    cmaes needs its package, and without it is an error naming the install."""
    from hydraddp.search.space import parse

    search = _search_of(f"hydra/sweeper/sampler={name}", "hydra.sweeper.sampler.seed=7")
    space = parse([f"{LR}=choice(0.01, 0.1)", "trainer.max_steps=range(10, 40, 10)"])
    if name == "cmaes" and importlib.util.find_spec("cmaes") is None:
        with pytest.raises(ImportError, match="cmaes"):
            search._made_sampler(space)
        return
    sampler = search._made_sampler(space)
    assert isinstance(sampler, getattr(optuna.samplers, SAMPLERS[name]))
    if name == "grid":  # every choice and range value of the space, each combination once
        assert sampler._search_space == {LR: [0.01, 0.1], "trainer.max_steps": [10, 20, 30]}


def test_a_grid_over_an_interval_is_exit_2_naming_it(tmp_path):
    done = run_cli(*SEARCH[:2], "hydra/sweeper/sampler=grid", f"{LR}=interval(0.01, 0.1)", "tracking.enabled=false",
                   cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"hydra/sweeper/sampler=grid searches choices and ranges; {LR} is an interval" in done.stderr


@pytest.mark.slow
def test_the_fastest_fit_search_prunes_what_its_plan_says_will_not_fit_and_finds_a_pareto_front(mlflow_server,
                                                                                              tmp_path):
    """``experiment=fastest_fit`` on one slice of its grid: fp32 DDP without activation checkpointing, accumulation
    1 (planned 48 MiB per rank, over the 30 MiB budget) or 4 (25 MiB). The first is PRUNED by its plan and never
    launched; the second trains, and is the Pareto front of samples/s and tensor memory."""
    experiment = f"fit-{uuid.uuid4().hex[:6]}"
    done = run_cli("-m", "experiment=fastest_fit", "hydra.sweeper.params=null", "wrap=ddp", "precision=fp32",
                   "trainer.activation_checkpointing=false", "trainer.accumulate_grad_batches=choice(1,4)",
                   "hydra.sweeper.n_trials=2", "hydra.sweep.dir=sweep",
                   *tracked(mlflow_server, experiment), cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = {t.params["trainer.accumulate_grad_batches"]: t
              for t in study(tmp_path / "optuna.db", re.search(r"study '(\S+)'", done.stdout)[1]).get_trials()}
    over, fits = trials[1], trials[4]
    assert over.state.name == "PRUNED" and "over the memory budget of 0.03 GiB: not launched" in \
        over.user_attrs["hydraddp_plan"]
    assert not (tmp_path / "sweep" / f"trial-{over.number}").exists()  # never launched
    assert fits.state.name == "COMPLETE" and len(fits.values) == 2 and fits.values[0] > 0
    assert f"{fits.number}*" in done.stdout and f"Pareto front (*): trials {fits.number}" in done.stdout
    [parent] = [r for r in runs_of(mlflow_server, experiment) if names.TAG_SWEEP in r.data.tags]
    assert parent.data.tags["hydraddp.pareto_front"] == str(fits.number)
    [front] = json.loads(parent.data.tags["hydraddp.pareto_front_runs"])
    assert front["trial"] == fits.number and front["values"] == fits.values and front["run_id"]
    artifacts = {a.path for a in mlflow_server.client().list_artifacts(parent.info.run_id, "search")}
    assert "search/pareto_front.png" in artifacts


def test_several_metrics_need_as_many_directions_and_no_pruner(tmp_path):
    for bad, said in ((["hydra.sweeper.metric=[eval/loss,perf/samples_per_s]"],
                       "hydra.sweeper.metric has 2 metrics and hydra.sweeper.direction 1 directions"),
                      (["hydra.sweeper.metric=[eval/loss,memory/peak_gib]",
                        "hydra.sweeper.direction=[minimize,minimize]", "hydra.sweeper.pruner=median"],
                       "optuna prunes single-objective studies only")):
        done = run_cli(*SEARCH[:2], *bad, f"{LR}=choice(0.01, 0.1)", "tracking.enabled=false", cwd=tmp_path,
                       timeout=120)
        assert done.returncode == 2 and said in done.stderr, (bad, done.stderr[-2000:])
