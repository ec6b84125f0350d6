"""The training and evaluation sets as MLflow run inputs: against a real ``mlflow server``, every run holds a
``train`` and an ``eval`` input with name, digest, source, schema and profile, and the digest follows the data
(the same in two runs on the same data, another under another split seed); plus the digest itself, and the
schema MLflow's own numpy datasets write."""

import json
import uuid

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from hydraddp.data.digits import digits
from hydraddp.data.text import token_dicts
from hydraddp.redaction import REDACTED
from hydraddp.tracking import inputs as tracker_inputs
from hydraddp.tracking import names
from hydraddp.tracking.events import EVENTS_FILE, read_events
from hydraddp.tracking.run import LaunchRun
from hydraddp.train import inputs
from tests.helpers.spawn import NO_PLAN, job_dirs, run_cli
from tests.tracking.test_mlflow import QUICK, tracked

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

DIGITS = "hydraddp.data.digits.digits"


@pytest.fixture(scope="module")
def launches(mlflow_server, tmp_path_factory):
    """Three tiny launches: ``a`` and ``b`` on the same data, ``seed1`` on another split of it."""
    experiment = f"inputs-{uuid.uuid4().hex[:6]}"
    client, out = mlflow_server.client(), {}
    for label, extra in (("a", []), ("b", []), ("seed1", ["data.dataset.seed=1"])):
        cwd = tmp_path_factory.mktemp(label)
        done = run_cli(*extra, *QUICK, NO_PLAN, *tracked(mlflow_server, experiment), cwd=cwd)
        assert done.returncode == 0, done.stderr[-3000:]
        [job] = job_dirs(cwd)
        out[label] = (client.get_run((job / names.RUN_ID_FILE).read_text().strip()), job)
    return out


def by_context(run):
    found = {}
    for entry in run.inputs.dataset_inputs:
        [context] = [t.value for t in entry.tags if t.key == "mlflow.data.context"]
        assert context not in found, f"two {context} inputs in run {run.info.run_id}"
        found[context] = entry.dataset
    return found


def test_every_run_has_its_train_and_eval_sets_as_inputs(launches):
    from mlflow.data.schema import TensorDatasetSchema

    for label, (run, _) in launches.items():
        sets = by_context(run)
        assert sorted(sets) == ["eval", "train"]  # once each, though two ranks trained
        seed = 1 if label == "seed1" else 0
        for context, samples in (("train", 1528), ("eval", 269)):  # 1797 digits, 15% held out
            dataset = sets[context]
            assert dataset.name == f"digits/{context}"
            assert len(dataset.digest) == 16
            assert dataset.source_type == "code"
            assert json.loads(dataset.source) == {"tags": {"_target_": DIGITS, "eval_fraction": 0.15, "seed": seed}}
            schema = TensorDatasetSchema.from_dict(json.loads(dataset.schema))
            [features], [targets] = schema.features.inputs, schema.targets.inputs
            assert (str(features.type), features.shape) == ("float32", (-1, 64))
            assert (str(targets.type), targets.shape) == ("int64", (-1,))
            assert json.loads(dataset.profile) == {"num_samples": samples, "hashed_samples": samples}


def test_the_digest_follows_the_data(launches):
    a, b, other = (by_context(launches[label][0]) for label in ("a", "b", "seed1"))
    for context in ("train", "eval"):
        assert a[context].digest == b[context].digest
        assert a[context].digest != other[context].digest  # data.dataset.seed=1 splits the digits otherwise
    assert a["train"].digest != a["eval"].digest


def test_an_input_sent_again_is_not_logged_twice(launches, mlflow_server):
    # What a continued run (a resume, tracking.run_id=...) or a request retried after a timeout sends again.
    run, job = launches["a"]
    events, _ = read_events(job / EVENTS_FILE)
    payloads = [event["input"] for event in events if "input" in event]
    assert len(payloads) == 2
    again = LaunchRun(mlflow_server.uri, "", job, {}, [], {}, run_id=run.info.run_id)
    again._client = mlflow_server.client()
    for payload in payloads:
        tracker_inputs.log_input(again, payload)
    after = by_context(mlflow_server.client().get_run(run.info.run_id))
    assert {c: d.digest for c, d in after.items()} == {c: d.digest for c, d in by_context(run).items()}


def test_tracking_datasets_false_records_no_input(tmp_path):
    from hydraddp.config.compose import compose
    from hydraddp.tracking.events import EventWriter
    from hydraddp.train.loop import train

    cfg = compose(["backend=none", "wrap=none", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
                   "tracking.datasets=false", "tracking.model.enabled=false"])
    writer = EventWriter(tmp_path / EVENTS_FILE)
    try:
        train(cfg, tmp_path, writer)
    finally:
        writer.close()
    events, _ = read_events(tmp_path / EVENTS_FILE)
    assert any(event.get("metric") == names.LOSS for event in events)  # the events were written
    assert not [event for event in events if "input" in event]


# -- the digest, the description and the schema, without a server --------------------------------------------------
class Samples(Dataset):
    """The samples of a TensorDataset, one __getitem__ at a time (the path every other dataset takes)."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def __len__(self):
        return len(self.tensors[0])

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)


def test_same_samples_same_digest_one_value_changed_another():
    x, y = torch.arange(600, dtype=torch.float32).reshape(100, 6), torch.arange(100) % 10
    digest = inputs.content_digest(TensorDataset(x, y)).digest
    assert inputs.content_digest(TensorDataset(x.clone(), y.clone())).digest == digest
    assert inputs.content_digest(Samples(x, y)).digest == digest  # either path, the same samples
    changed = x.clone()
    changed[57, 3] += 1
    assert inputs.content_digest(TensorDataset(changed, y)).digest != digest
    assert inputs.content_digest(Samples(changed, y)).digest != digest
    assert inputs.content_digest(TensorDataset(x[:99], y[:99])).digest != digest
    assert inputs.content_digest(TensorDataset(x.double(), y)).digest != digest  # same values, another dtype


def test_dict_samples_digest_their_values():
    train, evaluation = token_dicts(num_chars=20_000)
    again, _ = token_dicts(num_chars=20_000)
    other, _ = token_dicts(num_chars=20_000, seed=1)
    content = inputs.content_digest(train)
    assert content.sample == "dict"
    assert content.fields == [{"name": "input_ids", "dtype": "int64", "shape": [64]},
                              {"name": "labels", "dtype": "int64", "shape": [64]}]
    assert inputs.content_digest(again).digest == content.digest
    assert inputs.content_digest(other).digest != content.digest
    assert inputs.content_digest(evaluation).digest != content.digest


def test_beyond_the_limit_an_even_stride_over_the_whole_set_is_hashed():
    assert list(inputs.sample_indices(10, 4)) == [0, 3, 6, 9]
    assert list(inputs.sample_indices(3, 4)) == [0, 1, 2]
    x = torch.arange(1000, dtype=torch.float32).reshape(1000, 1)
    digest = inputs.content_digest(TensorDataset(x), max_samples=10)
    assert (digest.num_samples, digest.hashed_samples) == (1000, 10)
    last = x.clone()
    last[-1] = -1  # the last sample is always among the hashed ones
    assert inputs.content_digest(TensorDataset(last), max_samples=10).digest != digest.digest
    assert inputs.content_digest(Samples(x), max_samples=10).digest == digest.digest
    # a byte budget bounds big samples as the sample limit bounds many
    assert inputs.content_digest(TensorDataset(x), max_bytes=40).hashed_samples == 10


def test_variable_sized_samples_show_in_the_schema_and_the_digest():
    class Ragged(Dataset):
        def __init__(self, sizes):
            self.sizes = sizes

        def __len__(self):
            return len(self.sizes)

        def __getitem__(self, index):
            return {"tokens": torch.ones(self.sizes[index], dtype=torch.long), "text": "x" * self.sizes[index]}

    content = inputs.content_digest(Ragged([2, 1]))
    assert content.fields == [{"name": "tokens", "dtype": "int64", "shape": [-1]},
                              {"name": "text", "dtype": "str", "shape": []}]
    assert inputs.content_digest(Ragged([1, 2])).digest != content.digest  # the same bytes, split otherwise


def test_the_description_redacts_the_source_and_names_the_split():
    from omegaconf import OmegaConf

    train, _ = digits()
    cfg = OmegaConf.create({"data": {"dataset": {"_target_": DIGITS, "seed": 0, "api_token": "hunter2"}}})
    payload = inputs.describe(train, cfg, inputs.TRAIN)
    assert payload["name"] == "digits/train" and payload["context"] == "train"
    assert payload["source"] == {"_target_": DIGITS, "seed": 0, "api_token": REDACTED}
    assert payload["profile"] == {"num_samples": 1528, "hashed_samples": 1528}


def test_the_schema_is_the_one_mlflow_writes_for_numpy_data():
    import mlflow.data
    from mlflow.data.code_dataset_source import CodeDatasetSource

    def theirs(features, targets):
        dataset = mlflow.data.from_numpy(features, targets=targets, source=CodeDatasetSource({}))
        return json.loads(dataset.to_dict()["schema"])

    def ours(dataset):
        payload = inputs.describe(dataset, {"data": {"dataset": {}}}, "train")
        return json.loads(tracker_inputs.tensorspec(payload["schema"]))

    train, _ = digits()
    x, y = train.tensors
    assert ours(train) == theirs(x.numpy(), y.numpy())
    tokens, _ = token_dicts(num_chars=20_000)
    ids = tokens[0]["input_ids"].numpy()[None]
    assert ours(tokens) == theirs({"input_ids": ids}, {"labels": ids})
