"""One tree-map for batches and outputs: every container keeps its type, through the fp32 output cast of every
low precision and through moving a batch (no process group needed)."""

import collections
import dataclasses

import pytest
import torch
from torch import nn

from hydraddp.parallel.precision import add_precision_hooks, precision_spec
from hydraddp.parallel.trees import cast_floats, map_tensors, tensors
from hydraddp.train.tasks import to_device

Pair = collections.namedtuple("Pair", "logits aux")


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    label: str


class NamedTupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return Pair(self.linear(x), {"ids": torch.arange(3), "score": self.linear(x).sum()})


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-true"])
def test_a_namedtuple_output_keeps_its_type_and_comes_back_in_fp32(precision):
    spec = precision_spec(precision)
    model = NamedTupleOut().to(spec.storage_dtype)
    add_precision_hooks(model, spec, "cpu", autocast=True)
    out = model(torch.randn(2, 4))
    assert type(out) is Pair
    assert out.logits.dtype == torch.float32 and out.aux["score"].dtype == torch.float32
    assert out.aux["ids"].dtype == torch.int64  # integer tensors are not cast


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-true"])
def test_a_hugging_face_model_output_keeps_its_type_and_attributes(precision):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    spec = precision_spec(precision)
    model = transformers.LlamaForCausalLM(config).to(spec.storage_dtype)
    add_precision_hooks(model, spec, "cpu", autocast=True)
    out = model(input_ids=torch.randint(0, 32, (2, 5)), labels=torch.randint(0, 32, (2, 5)))
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    assert out.logits.dtype == torch.float32 and out.loss.dtype == torch.float32 and out["logits"] is out.logits


def test_batches_keep_namedtuples_dataclasses_and_objects_that_move_themselves():
    moved = []

    class MovesItself:
        def to(self, device):
            moved.append(device)
            return self

    batch = {"pair": Pair(torch.ones(2), torch.zeros(2, dtype=torch.long)), "data": Batch(torch.ones(1), "a"),
             "encoding": MovesItself(), "n": 3}
    out = to_device(batch, torch.device("cpu"))
    assert type(out["pair"]) is Pair and out["data"] == Batch(torch.ones(1), "a") and out["n"] == 3
    assert moved == [torch.device("cpu")]
    doubled = map_tensors(batch, lambda t: t * 2)
    assert torch.equal(doubled["data"].inputs, torch.full((1,), 2.0))
    assert [t.tolist() for t in tensors(batch)] == [[1.0, 1.0], [0, 0], [1.0]]
    assert cast_floats(Pair(torch.ones(1), torch.ones(1, dtype=torch.long)), torch.float64).logits.dtype == torch.float64
