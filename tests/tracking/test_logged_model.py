"""The trained model as an MLflow LoggedModel of the run, against a real `mlflow server`: it loads back and computes
what the trained model computes, under ddp and fsdp2; it is the run's output at its step; above
tracking.model.max_copy_mb it refers to the checkpoint instead; logging it leaves the run's status alone."""

import time
import uuid
from pathlib import Path

import pytest
import torch

from hydraddp.export import export
from hydraddp.tracking import names
from hydraddp.tracking.run import LaunchRun, mlflow_client
from hydraddp.handoff.checkpoints import step_dir
from hydraddp.train.model_snapshot import model_folder
from tests.helpers.spawn import NO_PLAN, job_dirs, run_cli
from tests.tracking.test_mlflow import QUICK, tracked

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

STEPS = 12  # QUICK's trainer.max_steps


def launched(cwd: Path, *overrides: str) -> tuple[Path, str]:
    """Run one launch in ``cwd``: its job directory and MLflow run id."""
    done = run_cli(*QUICK, NO_PLAN, *overrides, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    [job] = job_dirs(cwd)
    return job, (job / names.RUN_ID_FILE).read_text().strip()


def models_of(server, experiment: str) -> list:
    import mlflow

    mlflow.set_tracking_uri(server.uri)
    found = server.client().get_experiment_by_name(experiment)
    return [] if found is None else mlflow.search_logged_models(experiment_ids=[found.experiment_id],
                                                                output_format="list")


def model_steps(server, run_id: str) -> dict[str, int]:
    """The run's LoggedModel outputs: model id -> step."""
    return {o.model_id: o.step for o in server.client().get_run(run_id).outputs.model_outputs}


def trained_model(checkpoint: Path, tmp_path: Path) -> torch.nn.Module:
    """The model as training left it, rebuilt from its checkpoint the documented way (python -m hydraddp.export)."""
    from hydraddp.models.mlp import MLP

    model = MLP()  # the default model=mlp, as the launches train it
    model.load_state_dict(torch.load(export(checkpoint, tmp_path / "model.pt"), weights_only=True))
    return model.eval()


INPUT = torch.rand(16, 64, generator=torch.Generator().manual_seed(0))  # digits: 64 pixels in [0, 1]


@pytest.fixture(scope="module")
def experiment():
    return f"models-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def ddp_and_fsdp2(mlflow_server, tmp_path_factory, experiment):
    """Two launches of 2 ranks; the ddp one also logs a model at its periodic checkpoint of step 6."""
    every = {"ddp": ["checkpoint.every_n_steps=6", "tracking.model.every_checkpoint=true"], "fsdp2": []}
    return {wrap: launched(tmp_path_factory.mktemp(wrap), f"wrap={wrap}", "checkpoint.save_last=true", *every[wrap],
                           *tracked(mlflow_server, experiment, model=True))
            for wrap in ("ddp", "fsdp2")}


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_the_logged_model_computes_what_the_trained_model_computes(mlflow_server, ddp_and_fsdp2, wrap, tmp_path):
    import mlflow

    job, run_id = ddp_and_fsdp2[wrap]
    [model_id] = [m for m, step in model_steps(mlflow_server, run_id).items() if step == STEPS]
    mlflow.set_tracking_uri(mlflow_server.uri)
    loaded = mlflow.pytorch.load_model(f"models:/{model_id}")
    with torch.no_grad():
        assert torch.allclose(loaded(INPUT), trained_model(step_dir(job / "checkpoints", STEPS), tmp_path)(INPUT),
                              rtol=0, atol=1e-6)
    signature = mlflow.models.get_model_info(f"models:/{model_id}").signature
    [spec] = signature.inputs.inputs
    assert (str(spec.type), spec.shape) == ("float32", (-1, 64)) and signature.outputs.inputs[0].shape == (-1, 10)
    assert not (model_folder(job, STEPS) / "state_dict.pt").exists()  # MLflow holds the copy now


def test_the_logged_models_are_the_runs_outputs_at_their_steps(mlflow_server, ddp_and_fsdp2, experiment):
    logged = models_of(mlflow_server, experiment)
    client = mlflow_server.client()
    for wrap, (_, run_id) in ddp_and_fsdp2.items():
        steps = model_steps(mlflow_server, run_id)
        mine = {m.model_id: m for m in logged if m.source_run_id == run_id}
        assert mine.keys() == steps.keys()
        assert list(steps.values()).count(STEPS) == 1  # (and the ddp run's periodic one: the next test)
        for model_id, step in steps.items():
            model = mine[model_id]
            assert model.name == "model" and str(model.status) == "READY"
            assert model.tags["hydraddp.step"] == str(step)
            assert model.tags["hydraddp.model"] == "hydraddp.models.mlp.MLP"
            assert model.params["wrap.name"] == wrap  # the run's params
            assert {m.step for m in model.metrics} <= {step}  # the run's metrics of that step, if any
        [final] = [mine[m] for m, step in steps.items() if step == STEPS]
        assert {m.key for m in final.metrics} >= {names.LOSS, names.EVAL_LOSS, names.EVAL_ACCURACY}
        assert client.get_run(run_id).info.status == "FINISHED"


def test_every_checkpoint_logs_the_model_of_each_periodic_checkpoint(mlflow_server, ddp_and_fsdp2, tmp_path):
    import mlflow

    job, run_id = ddp_and_fsdp2["ddp"]
    steps = model_steps(mlflow_server, run_id)
    assert sorted(steps.values()) == [6, STEPS]  # the last step's once, after the final evaluation
    [model_id] = [m for m, step in steps.items() if step == 6]
    mlflow.set_tracking_uri(mlflow_server.uri)
    loaded = mlflow.pytorch.load_model(f"models:/{model_id}")
    with torch.no_grad():
        assert torch.allclose(loaded(INPUT), trained_model(step_dir(job / "checkpoints", 6), tmp_path)(INPUT),
                              rtol=0, atol=1e-6)


def test_a_model_above_max_copy_mb_refers_to_its_checkpoint(mlflow_server, tmp_path):
    experiment = f"external-{uuid.uuid4().hex[:6]}"
    # No checkpoint.save_last: the checkpoint the LoggedModel refers to is written for it.
    job, run_id = launched(tmp_path, "wrap=fsdp2", "tracking.model.max_copy_mb=0", *tracked(mlflow_server, experiment, model=True))
    [model] = models_of(mlflow_server, experiment)
    checkpoint = step_dir(job / "checkpoints", STEPS)
    assert model.source_run_id == run_id and model_steps(mlflow_server, run_id) == {model.model_id: STEPS}
    assert model.tags["hydraddp.checkpoint"] == str(checkpoint) and (checkpoint / "meta.json").exists()
    assert model.tags["hydraddp.load"] == f"python -m hydraddp.export {checkpoint} OUT.pt"
    assert model.tags["mlflow.model.isExternal"] == "true"
    client = mlflow_server.client()
    assert [a.path for a in client.list_logged_model_artifacts(model.model_id)] == ["MLmodel"]  # no weights
    assert not model_folder(job, STEPS).joinpath("state_dict.pt").exists()
    assert client.get_run(run_id).info.status == "FINISHED"


def test_tracking_model_enabled_false_logs_none(mlflow_server, tmp_path):
    experiment = f"nomodel-{uuid.uuid4().hex[:6]}"
    job, run_id = launched(tmp_path, "backend=none", "launcher.nproc_per_node=1", "tracking.model.enabled=false",
                           *tracked(mlflow_server, experiment, model=True))
    assert models_of(mlflow_server, experiment) == [] and model_steps(mlflow_server, run_id) == {}
    assert not (job / "model").exists()


def test_logging_leaves_the_run_running_and_logs_a_retried_event_once(mlflow_server, tmp_path):
    """The tracker's handler alone, as the launch's tracker calls it before it sets the status."""
    import mlflow

    from hydraddp.models.mlp import MLP
    from hydraddp.tracking.logged_model import log_model

    client = mlflow_server.client()
    experiment_id = client.create_experiment(f"handler-{uuid.uuid4().hex[:6]}")
    run_id = client.create_run(experiment_id).info.run_id
    run = LaunchRun(mlflow_server.uri, "", tmp_path, {"wrap": {"name": "ddp"}}, [], {}, run_id=run_id)
    run._client = mlflow_client(mlflow_server.uri)
    folder = model_folder(tmp_path, 3)
    folder.mkdir(parents=True)
    trained = MLP()
    torch.save(trained.state_dict(), folder / "state_dict.pt")
    torch.save(INPUT[:4], folder / "input_example.pt")
    payload = {"step": 3, "target": "hydraddp.models.mlp.MLP", "folder": str(folder), "size_bytes": 0,
               "model_config": {"_target_": "hydraddp.models.mlp.MLP"}, "state_dict": str(folder / "state_dict.pt"),
               "input_example": str(folder / "input_example.pt")}
    began = time.perf_counter()
    log_model(run, payload)
    print(f"logging the default MLP took {time.perf_counter() - began:.2f} s")
    log_model(run, payload)  # the same event again: a tracker that died before committing its offset
    assert client.get_run(run_id).info.status == "RUNNING" and mlflow.active_run() is None
    [model_id] = model_steps(mlflow_server, run_id)
    mlflow.set_tracking_uri(mlflow_server.uri)
    with torch.no_grad():
        assert torch.equal(mlflow.pytorch.load_model(f"models:/{model_id}")(INPUT), trained(INPUT))


def test_a_checkpoint_a_logged_model_names_is_never_pruned(mlflow_server, tmp_path):
    """Above max_copy_mb a LoggedModel names its checkpoint; keep_last=1 once pruned the ones of steps 4 and 8 two saves
    later, and the models' hydraddp.checkpoint tags pointed at nothing."""
    experiment = f"pinned-{uuid.uuid4().hex[:6]}"
    job, _ = launched(tmp_path, "wrap=fsdp2", "tracking.model.max_copy_mb=0", "tracking.model.every_checkpoint=true",
                      "checkpoint.every_n_steps=4", "checkpoint.keep_last=1",
                      *tracked(mlflow_server, experiment, model=True))
    named = sorted(Path(m.tags["hydraddp.checkpoint"]) for m in models_of(mlflow_server, experiment))
    assert named == [step_dir(job / "checkpoints", step) for step in (4, 8, STEPS)]
    assert all((path / "meta.json").exists() for path in named)  # each loads: python -m hydraddp.export works
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == [p.name for p in named]
