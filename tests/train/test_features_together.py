"""Every trainer feature meets every wrap and the defaults of everything else: the plan (recorded and measured),
MLflow tracking and checkpoints stay on as a user gets them. Features were once tested alone, and
``trainer.accumulate_grad_batches=4`` crashed in the default plan's measured step.

Pairwise: each feature with each wrap that allows it, and each pair of features together in some launch. A row
with ``stop`` stops at step 4 and is resumed (``checkpoint.resume=latest``) into the same MLflow run."""

import re

import pytest

from tests.helpers.spawn import job_dirs, run_cli

pytestmark = pytest.mark.slow  # launches for real: see README, Tests

FEATURES = {
    "accumulate": "trainer.accumulate_grad_batches=2",
    "checkpointing": "trainer.activation_checkpointing=true",
    "compile": "trainer.compile=true",
    "no_decay": "optim.no_decay_norm_and_bias=true",
    "stop": "trainer.stop_at_step=4",
}
# The smallest GPT with what every feature acts on: blocks (checkpointing, compile, FSDP units), norms and biases.
SMALLEST = ["model=gpt", "data=text", "task=causal_lm", "model.depth=2", "model.dim=16", "model.heads=2",
            "data.seq_len=16", "data.batch_size=8", "data.eval_batch_size=16", "data.dataset.num_chars=4000",
            "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=3"]
# FSDP1 is never compiled (the rules refuse it: Dynamo does not trace its flat parameters).
ROWS = [
    ("ddp", ["accumulate", "checkpointing", "compile", "stop"]),
    ("ddp", ["no_decay"]),
    ("fsdp", ["accumulate", "no_decay", "stop"]),
    ("fsdp", ["checkpointing"]),
    ("fsdp2", ["accumulate", "checkpointing", "no_decay"]),
    ("fsdp2", ["compile", "no_decay", "stop"]),
]


def test_the_rows_cover_every_feature_with_every_wrap_and_every_pair():
    for feature in FEATURES:
        for wrap in ("ddp", "fsdp", "fsdp2"):
            if (wrap, feature) != ("fsdp", "compile"):
                assert any(w == wrap and feature in f for w, f in ROWS), (wrap, feature)
        for other in FEATURES:
            if other != feature:
                assert any(feature in f and other in f for _, f in ROWS), (feature, other)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("wrap, features", ROWS, ids=["-".join([w, *f]) for w, f in ROWS])
def test_features_together_under_every_wrap_with_every_default_on(tmp_path, wrap, features):
    # One database for both launches (by default each working directory has its own): the resume continues the run.
    overrides = [f"wrap={wrap}", *SMALLEST, *(FEATURES[f] for f in features), f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    first = run_cli(*overrides, cwd=tmp_path / "first", timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    [job] = job_dirs(tmp_path / "first")
    log = (job / "logs" / "rank0.log").read_text()
    assert f"auto_model: wrap={wrap}" in log
    stopped_at = 4 if "stop" in features else 6
    assert f"step {stopped_at} loss" in log and f"step {stopped_at + 1} loss" not in log
    assert (job / "plan.json").exists()  # the plan was made and recorded beside the run
    if "stop" not in features:
        return
    resumed = run_cli(*[o for o in overrides if o != FEATURES["stop"]], "checkpoint.resume=latest",
                      f"checkpoint.dir={job / 'checkpoints'}", cwd=tmp_path / "resumed", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    [again] = job_dirs(tmp_path / "resumed")
    steps = [int(s) for s in re.findall(r"step (\d+) loss", (again / "logs" / "rank0.log").read_text())]
    assert steps == [5, 6]  # it went on from the stop
    assert (again / "mlflow_run_id").read_text() == (job / "mlflow_run_id").read_text()  # into the same run
