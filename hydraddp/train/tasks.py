"""The objective seam: what one batch costs and what evaluation reports. The loop knows nothing else about the task.

A task is any object with a ``loss`` method, and optionally the two evaluation methods
(``task._target_=mypkg.MyTask`` builds one from config)::

    loss(model, batch) -> Tensor                    # the mean loss of this rank's batch, to backpropagate
    eval_sums(model, batch) -> dict[str, Tensor]    # sums over the batch (e.g. loss_sum, correct, count)
    summarize(sums: dict[str, float]) -> dict[str, float]   # the sums of every rank's eval shard -> metrics

Without ``eval_sums``/``summarize``, evaluation reports ``loss``: the batches' losses weighted by their sizes.
A task whose loss is a mean over something other than samples (tokens that count) may say how many a batch holds,
``loss_weight(batch) -> int``, so that accumulated micro-batches add up to the mean over the whole batch.

``batch`` is already on the device (``to_device``: tensors inside tuples, lists, dicts and dataclasses move).
Evaluation adds every rank's ``eval_sums`` in one all-reduce, then ``summarize`` turns them into metrics;
each metric is logged as ``eval/<name>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hydraddp.parallel.trees import map_tensors, tensors

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here" (padding, prompt tokens)


class TaskInputError(TypeError):
    """A batch or a model output the task cannot read. The message names the task, what it got and what it expects."""

    def __init__(self, task: object, what: str, got: Any, expected: str):
        super().__init__(f"task {type(task).__name__}: the {what} is {_describe(got)}; expected {expected}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``: tensors, tuples, namedtuples, lists, dicts, dataclasses, and
    objects with their own ``.to`` (Hugging Face's ``BatchEncoding``)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True), lambda b: b.to(device))


def split(batch: Any, parts: int) -> list[Any]:
    """``batch`` as ``parts`` micro-batches of equal size: every tensor cut along its first dimension, anything
    else repeated. ``parts`` must divide the batch (validation says so before launch)."""
    if parts == 1:
        return [batch]
    size = batch_size(batch)
    if size % parts:
        raise ValueError(f"a batch of {size} does not split into {parts} equal micro-batches")
    step = size // parts
    return [map_tensors(batch, lambda t, i=i: t[i * step:(i + 1) * step] if t.dim() else t) for i in range(parts)]


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 when it has none)."""
    first = next(tensors(batch), None)
    return 0 if first is None else (first.shape[0] if first.dim() else 1)


def tokens_per_sample(batch: Any) -> int | None:
    """Sequence length for MFU: the second dimension of the batch's first tensor, None for flat samples."""
    first = next(tensors(batch), None)
    return first.shape[1] if first is not None and first.dim() > 1 else None


def eval_sums(task: Any, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """The task's own ``eval_sums``, else its loss times the batch size (and the batch size)."""
    if callable(getattr(task, "eval_sums", None)):
        return task.eval_sums(model, batch)
    size = batch_size(batch)
    return {"loss_sum": task.loss(model, batch).detach() * size, "count": torch.tensor(size)}


def loss_weight(task: Any, batch: Any) -> int:
    """What the task's mean loss of ``batch`` averages over: the task's own ``loss_weight``, else the samples."""
    if callable(getattr(task, "loss_weight", None)):
        return int(task.loss_weight(batch))
    return batch_size(batch)


def summarize(task: Any, sums: dict[str, float]) -> dict[str, float]:
    """The task's own ``summarize``, else the mean loss over the samples."""
    if callable(getattr(task, "summarize", None)):
        return task.summarize(sums)
    return {"loss": sums["loss_sum"] / max(sums["count"], 1)}


def _field(output: Any, name: str) -> Any:
    """``output.name`` or ``output[name]`` (a ``ModelOutput`` is both), else None."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def _logits(task: object, output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = _field(output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    raise TaskInputError(task, "model output", output, "a logits tensor, or an output with .logits")


class Classification:
    """``(inputs, targets)`` batches, cross-entropy, accuracy. Logits may carry extra dims (a token per position):
    every position is one prediction."""

    name = "classification"

    def _split(self, batch: Any) -> tuple[Any, torch.Tensor]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
            return batch[0], batch[1]
        if isinstance(batch, Mapping) and isinstance(batch.get("labels"), torch.Tensor):
            return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
        raise TaskInputError(self, "batch", batch, "(inputs, targets) or a dict with 'labels'")

    def _forward(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self._split(batch)
        output = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
        logits = _logits(self, output)
        if logits.shape[:-1].numel() != targets.numel():
            raise TaskInputError(self, "model output", logits,
                                 f"logits with one row per target ({tuple(targets.shape)} targets)")
        return logits.flatten(0, -2), targets.flatten()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        logits, targets = self._forward(model, batch)
        return F.cross_entropy(logits, targets)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        logits, targets = self._forward(model, batch)
        return {"loss_sum": F.cross_entropy(logits.float(), targets, reduction="sum"),
                "correct": (logits.argmax(-1) == targets).sum(), "count": torch.tensor(targets.numel())}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums["count"], 1)
        return {"loss": sums["loss_sum"] / count, "accuracy": sums["correct"] / count}


def _dict_labels(batch: Mapping) -> torch.Tensor:
    """A token dict's labels: its ``labels``, or its ``input_ids`` with the padding (``attention_mask`` 0) masked."""
    if "labels" in batch:
        return batch["labels"]
    labels = batch["input_ids"]
    return labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX) if "attention_mask" in batch else labels


class CausalLM:
    """Next-token prediction; reports loss and perplexity.

    - A dict batch (``input_ids``, optional ``labels`` and ``attention_mask``) goes to the model as keywords. A
      model output with ``.loss`` (or ``["loss"]``) is used as it is (Hugging Face shifts the labels itself);
      otherwise the logits at position t predict the label at t+1, and ``-100`` labels count for nothing.
    - A tuple batch ``(inputs, targets)`` holds targets already shifted (the bundled text data): the logits at t
      predict ``targets[t]``.
    """

    name = "causal_lm"

    def _losses(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token losses, number of tokens that count)."""
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
            logits, labels = _logits(self, model(batch[0])), batch[1]
        elif isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
            output = model(**batch)
            labels = _dict_labels(batch)
            counted = (labels[..., 1:] != IGNORE_INDEX).sum()
            loss = _field(output, "loss")
            if isinstance(loss, torch.Tensor) and "labels" in batch:
                return loss.float() * counted, counted  # the model's own mean over the counted tokens
            logits, labels = _logits(self, output)[..., :-1, :], labels[..., 1:]
        else:
            raise TaskInputError(self, "batch", batch, "a dict with 'input_ids' (and 'labels'), or (inputs, targets)")
        if logits.shape[:-1] != labels.shape:
            raise TaskInputError(self, "model output", logits, f"logits of shape {tuple(labels.shape)} + (vocab,)")
        flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
        total = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return total, (flat_labels != IGNORE_INDEX).sum()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        total, count = self._losses(model, batch)
        return total / count.clamp(min=1)

    def loss_weight(self, batch: Any) -> int:
        """The tokens that count: the mean loss is over them, not over the sequences."""
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
            return int((_dict_labels(batch)[..., 1:] != IGNORE_INDEX).sum())
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
            return int((batch[1] != IGNORE_INDEX).sum())
        return batch_size(batch)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        total, count = self._losses(model, batch)
        return {"loss_sum": total, "tokens": count}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["tokens"], 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
