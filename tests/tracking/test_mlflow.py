"""One MLflow run per launch against a real `mlflow server` subprocess: tags, params, artifacts and
metrics by the contract's names; sweeps as parent and children; true final statuses; secrets kept out;
a server that goes away mid-run loses nothing."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from hydraddp.distributed.env import free_port
from hydraddp.redaction import REDACTED
from hydraddp.tracking import names
from tests.helpers.mlflow_server import MlflowServer
from tests.helpers.spawn import NO_MODEL, NO_PLAN, assert_no_orphans, child_env, interrupt_when, job_dirs, run_cli, run_process

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

QUICK = ["trainer.max_steps=12", "trainer.log_every=4", "trainer.eval_every=0"]
TAGS = ("hydraddp.backend", "hydraddp.wrap", "hydraddp.precision", "hydraddp.offload", "hydraddp.world_size")


def tracked(server, experiment, *, model=False):
    """Into ``experiment`` on the test server; the trained model only where it is checked (``NO_MODEL``)."""
    return [f"tracking.uri={server.uri}", f"tracking.experiment={experiment}", *([] if model else [NO_MODEL])]


def runs_of(server, experiment):
    client = server.client()
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def loss_steps(client, run_id):
    return sorted(m.step for m in client.get_metric_history(run_id, names.LOSS))


@pytest.fixture(scope="module")
def ddp_and_fsdp2(mlflow_server, tmp_path_factory):
    experiment = f"shards-{uuid.uuid4().hex[:6]}"
    for wrap in ("ddp", "fsdp2"):
        done = run_cli(f"wrap={wrap}", *QUICK, *tracked(mlflow_server, experiment, model=True),
                       cwd=tmp_path_factory.mktemp(wrap))
        assert done.returncode == 0, done.stderr[-3000:]
    runs = {r.data.tags["hydraddp.wrap"]: r for r in runs_of(mlflow_server, experiment)}
    assert sorted(runs) == ["ddp", "fsdp2"]
    return runs


def test_a_launch_is_one_run_with_the_contract_tags_and_artifacts(mlflow_server, ddp_and_fsdp2):
    run = ddp_and_fsdp2["fsdp2"]
    assert run.info.status == "FINISHED"
    assert {k: run.data.tags[k] for k in TAGS} == {"hydraddp.backend": "gloo", "hydraddp.wrap": "fsdp2",
                                                   "hydraddp.precision": "fp32", "hydraddp.offload": "none",
                                                   "hydraddp.world_size": "2"}
    assert run.data.params["wrap.name"] == "fsdp2" and run.data.params["launcher.nproc_per_node"] == "2"
    client = mlflow_server.client()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "overrides.yaml", "wrap_report.json", "logs"} <= artifacts
    report = json.loads(client.download_artifacts(run.info.run_id, "wrap_report.json", dst_path=None) and
                        open(client.download_artifacts(run.info.run_id, "wrap_report.json")).read())
    assert [r["rank"] for r in report] == [0, 1] and report[0]["wrapper"] == "fsdp2"
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs/node0")}
    assert logs == {"logs/node0/rank0.log", "logs/node0/rank1.log"}  # one node: node 0, both its ranks
    assert loss_steps(client, run.info.run_id) == [4, 8, 12]  # every logged step, once


def test_fsdp2_rank_shards_are_half_of_ddp(ddp_and_fsdp2):
    ddp, fsdp2 = ddp_and_fsdp2["ddp"].data.metrics, ddp_and_fsdp2["fsdp2"].data.metrics
    for rank in (0, 1):
        for field in ("param_bytes", "grad_bytes", "optim_state_bytes"):
            ratio = fsdp2[f"sharding/{field}/rank{rank}"] / ddp[f"sharding/{field}/rank{rank}"]
            assert 0.45 <= ratio <= 0.55, (field, rank, ratio)
    for base in ("sharding/param_bytes", "sharding/param_numel", "memory/peak_bytes"):
        ranks = [fsdp2[f"{base}/rank{r}"] for r in (0, 1)]
        assert fsdp2[f"{base}/max"] == max(ranks) and fsdp2[f"{base}/min"] == min(ranks)
        assert fsdp2[f"{base}/mean"] == pytest.approx(sum(ranks) / 2)
    assert fsdp2["memory/peak_bytes/rank0"] > 50e6  # a real process RSS, not a placeholder
    assert {names.SAMPLES_PER_S, names.STEP_TIME_S, names.LOSS} <= set(fsdp2)
    # From the command to the first optimizer step: more than importing torch takes, less than the whole run.
    run = ddp_and_fsdp2["fsdp2"].info
    assert 0.5 < fsdp2[names.STARTUP_S] < (run.end_time - run.start_time) / 1000 + 10


def test_a_worker_that_raises_leaves_the_run_failed_with_its_error(mlflow_server, tmp_path):
    experiment = f"fail-{uuid.uuid4().hex[:6]}"
    done = run_cli("optim.optimizer.lr=-1", *QUICK, *tracked(mlflow_server, experiment), cwd=tmp_path)
    assert done.returncode == 1
    [run] = runs_of(mlflow_server, experiment)
    assert run.info.status == "FAILED"
    assert "ValueError: Invalid learning rate: -1" in run.data.tags[names.TAG_ERROR]


def test_ctrl_c_leaves_the_run_killed_and_no_process(mlflow_server, tmp_path):
    experiment = f"kill-{uuid.uuid4().hex[:6]}"
    done = interrupt_when([sys.executable, "-m", "hydraddp", "trainer.max_steps=100000", "trainer.log_every=5",
                           *tracked(mlflow_server, experiment)], cwd=tmp_path,
                          ready=lambda: any(r.data.metrics.get(names.LOSS) for r in runs_of(mlflow_server, experiment)))
    assert done.returncode == 130, done.stderr[-3000:]
    [run] = runs_of(mlflow_server, experiment)
    assert run.info.status == "KILLED"


def test_a_secret_from_the_environment_never_reaches_mlflow(mlflow_server, tmp_path):
    experiment, secret = f"secret-{uuid.uuid4().hex[:6]}", f"s3cr3t-{uuid.uuid4().hex}"
    done = run_cli("+tracking.tags.team=${oc.env:HYDRADDP_TEST_SECRET}", "+tracking.tags.api_token=typed-" + secret,
                   *QUICK, *tracked(mlflow_server, experiment), cwd=tmp_path, env={"HYDRADDP_TEST_SECRET": secret})
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_of(mlflow_server, experiment)
    client = mlflow_server.client()
    seen = json.dumps([run.data.params, run.data.tags])
    for artifact in ("config.yaml", "overrides.yaml", "wrap_report.json"):
        seen += open(client.download_artifacts(run.info.run_id, artifact)).read()
    assert secret not in seen
    assert run.data.params["tracking.tags.team"] == REDACTED == run.data.tags["team"]
    assert yaml.safe_load(open(client.download_artifacts(run.info.run_id, "config.yaml")).read())[
        "tracking"]["tags"]["api_token"] == REDACTED


def test_an_unreachable_server_is_a_clear_error_before_anything_starts(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    done = run_cli(f"tracking.uri={uri}", cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert f"tracking.uri: the MLflow server at {uri} cannot be reached" in done.stderr
    assert "tracking.enabled=false" in done.stderr and "Traceback" not in done.stderr
    assert job_dirs(tmp_path) == []


def test_a_server_that_refuses_the_api_is_a_clear_error_before_any_rank_trains(mlflow_server, tmp_path):
    # The test server allows only localhost Host headers (MLflow 3's default), as the compose stack's server did for
    # "mlflow:5000". 127.1 is the loopback address spelled otherwise: /health answers (it is exempt), the API is 403.
    uri = mlflow_server.uri.replace("127.0.0.1", "127.1")
    done = run_cli(f"tracking.uri={uri}", *QUICK, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (f"tracking.uri: the MLflow server at {uri} answers /health but refuses its API with HTTP 403: "
            "'Invalid Host header - possible DNS rebinding attack detected'; start the server with --allowed-hosts "
            "naming the host and port in tracking.uri") in done.stderr
    assert "Traceback" not in done.stderr and job_dirs(tmp_path) == []  # no rank started, nothing half-written


def test_tracking_disabled_logs_nothing(tmp_path):
    done = run_cli("tracking.enabled=false", *QUICK, cwd=tmp_path)
    assert done.returncode == 0
    assert not (tmp_path / "mlflow.db").exists() and "MLflow run" not in done.stdout
    [job] = job_dirs(tmp_path)
    assert not (job / "events.jsonl").exists()


def test_under_torchrun_one_run_is_made(mlflow_server, tmp_path):
    experiment = f"torchrun-{uuid.uuid4().hex[:6]}"
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", "-m", "hydraddp", *QUICK, *tracked(mlflow_server, experiment)],
                       cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_of(mlflow_server, experiment)
    assert run.info.status == "FINISHED" and run.data.tags["hydraddp.world_size"] == "2"
    assert loss_steps(mlflow_server.client(), run.info.run_id) == [4, 8, 12]


def burn_cpu(loops: int = 1) -> list[subprocess.Popen]:
    """Busy loops at normal priority: with the two training ranks, more runnable processes than the machine's two
    cores, so the tracker (nice 19) competes for every slice. (One loop per core besides cost CI's cores about 25
    CPU-seconds more, to starve it no further.)"""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]


@pytest.mark.timeout(600)  # two server starts, a 20 s outage and busy loops: 3 minutes here beside other tests
def test_a_server_killed_for_20s_on_a_busy_machine_loses_no_point_and_logs_none_twice(tmp_path):
    server = MlflowServer(tmp_path / "server").start()
    experiment, token = "outage", uuid.uuid4().hex
    steps = 800
    # The plan is left out: made at idle priority, it would wait out the busy loops (and it is no part of this).
    proc = subprocess.Popen([sys.executable, "-m", "hydraddp", f"trainer.max_steps={steps}", "trainer.log_every=1",
                             "trainer.eval_every=0", "model.hidden=[32]", "tracking.flush_timeout_s=240", NO_PLAN,
                             *tracked(server, experiment)],
                            cwd=tmp_path, env=child_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    burners = []
    try:
        deadline = time.monotonic() + 180
        while not any(r.data.metrics.get(names.LOSS) for r in runs_of(server, experiment)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        burners = burn_cpu()  # busy from the outage on, not through the start-up, which is not what this tests
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server dies while the workers train on
        server.proc.wait()
        time.sleep(20)
        server.start(timeout_s=180)  # and comes back on the same port, with the same store
        out, err = proc.communicate(timeout=400)
        for burner in burners:
            burner.kill()
        assert proc.returncode == 0, err[-3000:]
        assert_no_orphans(token)
        [run] = runs_of(server, experiment)
        assert run.info.status == "FINISHED"
        client = server.client()
        for key in (names.LOSS, names.SAMPLES_PER_S, names.STEP_TIME_S):
            assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(1, steps + 1))
    finally:
        for burner in burners:
            burner.kill()
        proc.kill()
        server.stop()


def test_a_backlog_is_sent_within_mlflows_per_request_limits(mlflow_server, tmp_path):
    from hydraddp.tracking.events import EventWriter
    from hydraddp.tracking.run import LaunchRun

    events = EventWriter(tmp_path / "events.jsonl")
    for step in range(1, 1001):  # exactly MLflow's 1000 metrics, and a tag: one request would be refused
        events.metrics({names.LOSS: 1.0 / step}, step)
    events.tag("hydraddp.restarts", "1")
    for step in range(1001, 1101):
        events.metrics({names.LOSS: 1.0 / step, names.SAMPLES_PER_S: float(step)}, step)
    events.close()
    run = LaunchRun(mlflow_server.uri, f"limits-{uuid.uuid4().hex[:6]}", tmp_path, {"a": 1}, [], {})
    run._create()
    sizes, send = [], run._client.log_batch

    def recorded(run_id, metrics=(), params=(), tags=()):
        # Each call must be one request MLflow takes whole: the client splits larger ones into several
        # requests, and a failure between them used to resend (and duplicate) the ones that had landed.
        sizes.append((len(metrics), len(tags)))
        return send(run_id, metrics=metrics, params=params, tags=tags)

    run._client.log_batch = recorded
    while not run._send_pending():
        pass
    assert all(metrics <= 1000 and tags <= 100 and metrics + tags <= 1000 for metrics, tags in sizes), sizes
    client = mlflow_server.client()
    assert loss_steps(client, run.run_id) == list(range(1, 1101))
    assert client.get_run(run.run_id).data.tags["hydraddp.restarts"] == "1"
    assert int((tmp_path / "events.sent").read_text()) == (tmp_path / "events.jsonl").stat().st_size


def test_a_server_that_never_comes_back_keeps_the_points_and_says_how_to_send_them(tmp_path):
    server = MlflowServer(tmp_path / "server").start()
    experiment = "gone"
    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "hydraddp", "trainer.max_steps=120", "trainer.log_every=2",
                             "model.hidden=[1024,1024]", "tracking.flush_timeout_s=2", NO_PLAN,
                             *tracked(server, experiment)],
                            cwd=tmp_path, env=child_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("outputs/*/*/mlflow_run_id")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.02)  # the run exists: the server goes before the tracker (nice 19) can send much
        server.stop(graceful=False)  # it crashes: a graceful stop serves the tracker's open connection to the end
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert_no_orphans(token)
    [job] = job_dirs(tmp_path)
    command = re.search(r"python -m hydraddp\.tracking\.sync .*", out)
    assert command and str(job / "events.jsonl") in out
    server.start()
    try:
        sent = run_process([sys.executable, *command[0].split()[1:]], cwd=tmp_path, timeout=120)
        assert sent.returncode == 0, sent.stderr[-3000:]
        [run] = runs_of(server, experiment)
        assert run.info.status == "FINISHED"
        assert loss_steps(server.client(), run.info.run_id) == list(range(2, 121, 2))
    finally:
        server.stop()


def test_tracking_run_id_continues_an_existing_run(mlflow_server, tmp_path):
    experiment = f"continue-{uuid.uuid4().hex[:6]}"
    assert run_cli(*QUICK, *tracked(mlflow_server, experiment), cwd=tmp_path / "first").returncode == 0
    [first] = runs_of(mlflow_server, experiment)
    done = run_cli(*QUICK, "trainer.seed=1", f"tracking.run_id={first.info.run_id}", *tracked(mlflow_server, experiment),
                   cwd=tmp_path / "second")
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_of(mlflow_server, experiment)  # still one run
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    assert len(mlflow_server.client().get_metric_history(run.info.run_id, names.LOSS)) == 6


def test_every_run_records_its_plan_and_how_far_off_it_was(mlflow_server, ddp_and_fsdp2):
    client = mlflow_server.client()
    for wrap, run in ddp_and_fsdp2.items():
        params, metrics = run.data.params, run.data.metrics
        assert params["plan/wrap"] == wrap and params["plan/world_size"] == "2" and params["plan/unsure"] == "no"
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert names.PLAN_FILE in artifacts
        plan = json.loads(open(client.download_artifacts(run.info.run_id, names.PLAN_FILE)).read())
        assert int(params["plan/peak_bytes"]) == plan["peak_bytes"] > 0
        # Exact where the bytes are exact, and the tensor peak to 10%.
        for part in ("param_bytes", "grad_bytes", "optim_state_bytes"):
            assert metrics[f"plan/error/{part}"] == 0.0, (wrap, part)
            assert plan[part] == metrics[f"sharding/{part}/rank0"]
        assert abs(metrics["plan/error/peak_bytes"]) <= 0.10, (wrap, metrics["plan/error/peak_bytes"])
        assert metrics[f"{names.PEAK_TENSOR}/rank0"] > 0
