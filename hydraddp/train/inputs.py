"""The training and evaluation sets as run inputs: what each holds, described on the tracking rank.

Each set becomes one ``input`` event: a name (``digits/train``), a content digest, its source (the config's
``_target_`` and kwargs, redacted), the fields of a sample and the number of samples. The tracker logs it as an
MLflow dataset input (``hydraddp.tracking.inputs``); nothing here imports mlflow.

The digest hashes every sample up to ``MAX_SAMPLES`` (and ``MAX_BYTES``), and beyond that an even stride over the
whole set, plus its length: the bounded cost of MLflow's own numpy and pandas digests, spread over the set rather
than its head, so that a different split of the same rows shows.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import IterableDataset, TensorDataset

from hydraddp import redaction

log = logging.getLogger(__name__)
MAX_SAMPLES = 10_000  # MLflow's digest_utils.MAX_ROWS
MAX_BYTES = 64 * 2**20  # at most this much sample data is hashed (a fraction of a second)
# The split's name and its ``mlflow.data.context``, as MLflow's autologgers write it (sklearn, xgboost, keras).
TRAIN, EVAL = "train", "eval"
MAX_SOURCE_CHARS = 60_000  # MLflow keeps a dataset source of up to 65535 characters


@dataclass
class _Field:
    """One leaf of a sample: its dtype, the shape all hashed samples share (-1 where they differ), its hash."""

    name: str
    dtype: str
    shape: list[int] | None
    data: Any = field(default_factory=lambda: hashlib.md5(usedforsecurity=False))
    shapes: Any = field(default_factory=lambda: hashlib.md5(usedforsecurity=False))
    varies: bool = False

    def add(self, buffer: Any, shape: list[int] | None) -> None:
        self.data.update(buffer)
        # Variable-sized samples hash their sizes too: [ab][c] and [a][bc] are different sets.
        self.shapes.update(repr(shape).encode())
        if shape != self.shape:
            self.varies = True
            self.shape = _merged(self.shape, shape)

    def digest(self) -> bytes:
        return self.data.digest() + (self.shapes.digest() if self.varies else b"")

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape}


def _merged(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    if a is None or b is None or len(a) != len(b):
        return None  # not even the number of dimensions agrees
    return [x if x == y else -1 for x, y in zip(a, b)]


class Content(NamedTuple):
    """A dataset's digest and what it was taken from."""

    digest: str  # 16 hex characters
    sample: str  # "tuple", "dict" or "single": how a sample is structured
    fields: list[dict[str, Any]]  # per leaf of a sample: name, dtype, shape (per sample; -1 where samples differ)
    num_samples: int
    hashed_samples: int


def sample_indices(length: int, limit: int) -> range | list[int]:
    """Every index when ``length <= limit``, else ``limit`` indices evenly spread from the first to the last."""
    if length <= limit:
        return range(length)
    limit = max(limit, 2)
    return [i * (length - 1) // (limit - 1) for i in range(limit)]


def _leaves(sample: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """A sample's leaves with dotted names: dict keys, tuple positions (``0``, ``1``), nested as ``a.0``."""
    if isinstance(sample, Mapping):
        items = [(str(k), v) for k, v in sample.items()]
    elif isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)):
        items = [(str(i), v) for i, v in enumerate(sample)]
    else:
        return [(prefix, sample)]
    return [leaf for key, value in items for leaf in _leaves(value, f"{prefix}.{key}" if prefix else key)]


def _structure(sample: Any) -> str:
    if isinstance(sample, Mapping):
        return "dict"
    return "tuple" if isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)) else "single"


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    # As raw bytes: every dtype (bfloat16 too), no conversion.
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _leaf(value: Any) -> tuple[str, list[int] | None, Any]:
    """A leaf's dtype, shape and bytes. Tensors and arrays hash their raw data; anything else its pickle."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch."), list(value.shape), _tensor_bytes(value)
    if isinstance(value, (str, bytes)):
        data = value.encode() if isinstance(value, str) else value
        return type(value).__name__, [], b"%d:" % len(data) + data  # the length too: ["ab", "c"] is not ["a", "bc"]
    if isinstance(value, (bool, int, float, np.ndarray, np.generic)) or hasattr(value, "__array__"):
        try:
            array = np.ascontiguousarray(np.asarray(value))
            if array.dtype != object:
                return array.dtype.name, list(array.shape), array.reshape(-1).view(np.uint8)
        except (TypeError, ValueError, OverflowError):
            pass
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception:  # an object that does not pickle: its type alone
        data = b""
    return type(value).__qualname__, None, data


def _sample_bytes(sample: Any) -> int:
    return sum(len(_leaf(value)[2]) for _, value in _leaves(sample))


def content_digest(dataset: Any, max_samples: int = MAX_SAMPLES, max_bytes: int = MAX_BYTES) -> Content:
    """The digest of ``dataset``'s content: the same samples give the same digest, a changed value a different one.

    >>> same = TensorDataset(torch.zeros(4, 2))
    >>> content_digest(same).digest == content_digest(TensorDataset(torch.zeros(4, 2))).digest
    True
    """
    length = len(dataset)
    if length == 0:
        return Content(hashlib.md5(b"0", usedforsecurity=False).hexdigest()[:16], "single", [], 0, 0)
    first = dataset[0]
    limit = min(max_samples, max(max_bytes // max(_sample_bytes(first), 1), 2))
    indices = sample_indices(length, limit)
    if isinstance(dataset, TensorDataset):
        fields = _hash_tensor_rows(dataset, indices)
    else:
        fields = _hash_samples(dataset, first, indices)
    total = hashlib.md5(f"{length}:{len(indices)}".encode(), usedforsecurity=False)
    for leaf in fields:
        total.update(f"|{leaf.name}:{leaf.dtype}:".encode())
        total.update(leaf.digest())
    return Content(total.hexdigest()[:16], _structure(first), [f.schema() for f in fields], length, len(indices))


def _hash_samples(dataset: Any, first: Any, indices: Sequence[int]) -> list[_Field]:
    fields: dict[str, _Field] = {}
    for index in indices:
        sample = first if index == 0 else dataset[index]
        for name, value in _leaves(sample):
            dtype, shape, data = _leaf(value)
            leaf = fields.setdefault(name, _Field(name, dtype, shape))
            leaf.add(data, shape)
    return list(fields.values())


def _hash_tensor_rows(dataset: TensorDataset, indices: Sequence[int]) -> list[_Field]:
    """A ``TensorDataset``'s rows, a tensor at a time: the same digest as sample by sample, much faster."""
    rows = slice(None) if isinstance(indices, range) else torch.as_tensor(list(indices))
    fields = []
    for position, tensor in enumerate(dataset.tensors):
        leaf = _Field(str(position), str(tensor.dtype).removeprefix("torch."), list(tensor.shape[1:]))
        leaf.data.update(_tensor_bytes(tensor[rows]))
        fields.append(leaf)
    return fields


def _dataset_config(config: Any) -> dict[str, Any]:
    """``data.dataset`` of ``config`` (a DictConfig or the plain resolved dict), with its secrets redacted."""
    node = config["data"]["dataset"]
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    # The launch's saved config comes redacted already (values from ${oc.env:...} too); a DictConfig at least
    # loses every secret-looking key.
    return redaction.redact(plain, redaction.secret_paths(plain))


def describe(dataset: Any, config: Any, split: str) -> dict[str, Any]:
    """The ``input`` event of one split: name, digest, context, source, schema and profile."""
    source = _dataset_config(config)
    target = str(source.get("_target_") or f"{type(dataset).__module__}.{type(dataset).__qualname__}")
    source["_target_"] = target
    if len(repr(source)) > MAX_SOURCE_CHARS:  # kwargs too long for MLflow: the target alone says where it came from
        source = {"_target_": target, "truncated": True}
    content = content_digest(dataset)
    return {"name": f"{target.rsplit('.', 1)[-1]}/{split}", "digest": content.digest, "context": split,
            "source": source, "schema": {"sample": content.sample, "fields": content.fields},
            "profile": {"num_samples": content.num_samples, "hashed_samples": content.hashed_samples}}


def describe_datasets(config: Any, train_set: Any, eval_set: Any) -> list[dict[str, Any]]:
    """The ``input`` events of both splits. ``config``: the launch's config (its saved, redacted dict, or the
    DictConfig). A set that cannot be described is left out with a warning; training goes on."""
    payloads = []
    for split, dataset in ((TRAIN, train_set), (EVAL, eval_set)):
        if isinstance(dataset, IterableDataset):  # reading a user's stream here could cost, or consume, anything
            log.info("the %s set is a stream (an IterableDataset): not logged as a run input", split)
            continue
        began = time.perf_counter()
        try:
            payloads.append(describe(dataset, config, split))
        except Exception as exc:  # the input is the run's extra: it never stops training
            log.warning("the %s set is not logged as a run input (%s: %s)", split, type(exc).__name__, exc)
            continue
        log.info("%s set %s: digest %s of %d samples in %.2f s", split, payloads[-1]["name"], payloads[-1]["digest"],
                 payloads[-1]["profile"]["num_samples"], time.perf_counter() - began)
    return payloads


def record(events: Any, payloads: list[dict[str, Any]]) -> None:
    """The described sets to the tracker. Not before the launch's first step: an event activates the run it
    continues, and a launch that fails before that step must leave that run as it was."""
    for payload in payloads:
        events.record("input", payload)
