"""The objective seam (hydraddp/train/tasks.py): batches of every shape reach the device, each task computes the loss
its users expect, and what a task cannot read fails with a message naming the task, what it got and what it wants."""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hydraddp.train import tasks


class Moves:
    """An object with its own ``.to``, as Hugging Face's BatchEncoding."""

    def __init__(self, tensor):
        self.tensor = tensor

    def to(self, device):
        return Moves(self.tensor.to(device))


@dataclass
class Pair:
    x: torch.Tensor
    note: str = "kept"


def test_every_kind_of_batch_reaches_the_device():
    meta = torch.device("meta")
    Point = namedtuple("Point", "x y")
    batch = {"tuple": (torch.ones(2), [torch.zeros(1)]), "named": Point(torch.ones(1), 3),
             "dataclass": Pair(torch.ones(4)), "own_to": Moves(torch.ones(1)), "other": "text"}
    moved = tasks.to_device(batch, meta)
    assert moved["tuple"][0].device == meta and moved["tuple"][1][0].device == meta
    assert isinstance(moved["named"], Point) and moved["named"].x.device == meta and moved["named"].y == 3
    assert moved["dataclass"].x.device == meta and moved["dataclass"].note == "kept"
    assert moved["own_to"].tensor.device == meta and moved["other"] == "text"
    assert tasks.batch_size(batch) == 2 and tasks.batch_size({"input_ids": torch.zeros(5, 7)}) == 5


def test_classification_is_cross_entropy_and_accuracy():
    torch.manual_seed(0)
    model, inputs, targets = nn.Linear(4, 3), torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    task = tasks.Classification()
    assert task.loss(model, (inputs, targets)).item() == pytest.approx(F.cross_entropy(model(inputs), targets).item())
    sums = {k: float(v) for k, v in task.eval_sums(model, (inputs, targets)).items()}
    metrics = task.summarize(sums)
    assert metrics["accuracy"] == pytest.approx((model(inputs).argmax(-1) == targets).float().mean().item())
    assert metrics["loss"] == pytest.approx(F.cross_entropy(model(inputs), targets).item(), rel=1e-6)


class TinyLM(nn.Module):
    """Logits for every position; with ``labels`` it returns a ModelOutput-like object carrying its own loss."""

    def __init__(self, vocab=11, own_loss=False):
        super().__init__()
        self.embed, self.head, self.own_loss = nn.Embedding(vocab, 8), nn.Linear(8, vocab), own_loss

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.head(self.embed(input_ids))
        if not self.own_loss:
            return logits

        @dataclass
        class Output:
            logits: torch.Tensor
            loss: torch.Tensor | None = None

        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return Output(logits, loss)


def test_causal_lm_shifts_dict_batches_ignores_padding_and_uses_a_models_own_loss():
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (3, 6))
    labels = ids.clone()
    labels[:, :2] = -100  # a prompt that counts for nothing
    plain, own = TinyLM(), TinyLM(own_loss=True)
    own.load_state_dict(plain.state_dict())
    task = tasks.CausalLM()
    logits = plain(ids)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert task.loss(plain, {"input_ids": ids, "labels": labels}).item() == pytest.approx(expected.item(), rel=1e-6)
    assert task.loss(own, {"input_ids": ids, "labels": labels}).item() == pytest.approx(expected.item(), rel=1e-6)
    sums = {k: float(v) for k, v in task.eval_sums(own, {"input_ids": ids, "labels": labels}).items()}
    assert sums["tokens"] == 3 * 4  # labels 1..5 are predicted; label 1 is part of the prompt
    assert task.summarize(sums)["perplexity"] == pytest.approx(math.exp(expected.item()), rel=1e-5)
    # attention_mask without labels: the masked positions are not predicted
    mask = torch.ones_like(ids)
    mask[:, -1] = 0
    masked = F.cross_entropy(logits[:, :-2].flatten(0, 1), ids[:, 1:-1].flatten())
    assert task.loss(plain, {"input_ids": ids, "attention_mask": mask}).item() == pytest.approx(masked.item(), rel=1e-6)


def test_accumulated_micro_batches_weigh_by_the_tokens_that_count():
    """Micro-batches with unequal numbers of counted tokens: K=2 steps to the parameters of K=1 (one mean over every
    counted token of the batch), not to the mean of the two micro-batches' means."""
    from hydraddp.train.step import train_step

    torch.manual_seed(0)
    ids = torch.randint(0, 11, (4, 6))
    labels = ids.clone()
    labels[:2, :5] = -100  # the first micro-batch counts 2 tokens, the second 10
    batch = {"input_ids": ids, "labels": labels}
    params = {}
    for accumulate in (1, 2):
        torch.manual_seed(1)
        model = TinyLM()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        train_step(model, tasks.CausalLM(), batch, optimizer, None, None, False, accumulate)
        params[accumulate] = [p.detach().clone() for p in model.parameters()]
    for one, two in zip(params[1], params[2]):
        assert (one - two).abs().max().item() < 1e-6
    assert tasks.CausalLM().loss_weight(tasks.split(batch, 2)[0]) == 2


def test_causal_lm_on_tuple_batches_takes_targets_as_already_shifted():
    torch.manual_seed(0)
    model, inputs, targets = TinyLM(), torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))
    expected = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    assert tasks.CausalLM().loss(model, (inputs, targets)).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(("task", "batch", "model", "message"), [
    (tasks.Classification(), {"x": torch.zeros(2, 4)}, nn.Linear(4, 3),
     "task Classification: the batch is a dict with keys ['x']; expected (inputs, targets) or a dict with 'labels'"),
    (tasks.Classification(), (torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)), lambda x: [x],
     "task Classification: the model output is a list of 1; expected a logits tensor, or an output with .logits"),
    (tasks.CausalLM(), (torch.zeros(2, 4),), TinyLM(),
     "task CausalLM: the batch is a tuple of 1; expected a dict with 'input_ids' (and 'labels'), or (inputs, targets)"),
    (tasks.CausalLM(), {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, lambda input_ids: "text",
     "task CausalLM: the model output is a builtins.str; expected a logits tensor, or an output with .logits"),
])
def test_what_a_task_cannot_read_is_named(task, batch, model, message):
    with pytest.raises(tasks.TaskInputError) as caught:
        task.loss(model, batch)
    assert str(caught.value) == message


@pytest.mark.slow
def test_a_users_task_from_config_trains_on_two_ranks_and_is_recorded(tmp_path):
    """``task._target_=...`` with its own keyword: the loop trains with it, evaluation reports its metrics (eval/<name>
    in MLflow) and the run records the model's and the task's classes."""
    import json

    from mlflow.tracking import MlflowClient

    from tests.helpers.spawn import NO_PLAN, job_dirs, run_cli

    done = run_cli("trainer.max_steps=8", "trainer.log_every=4", "trainer.eval_every=4", NO_PLAN,
                   "task._target_=tests.train.user_task.TopTwo", "+task.label_smoothing=0.1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    [job] = job_dirs(tmp_path)
    result = json.loads((job / "result.json").read_text())
    assert sorted(result["eval_metrics"]) == ["loss", "top2_accuracy"] and result["eval_accuracy"] is None
    assert 0.0 <= result["eval_metrics"]["top2_accuracy"] <= 1.0
    assert "eval top2_accuracy" in done.stdout
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.data.tags["hydraddp.task"] == "tests.train.user_task.TopTwo"
    assert run.data.tags["hydraddp.model"] == "hydraddp.models.mlp.MLP"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/top2_accuracy")] == [4, 8]


