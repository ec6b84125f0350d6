"""A task as a user writes one (tests/train/test_tasks.py runs it through the CLI with task._target_=...)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


class TopTwo:
    """Cross-entropy, reporting how often the right class is among the two most likely."""

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def loss(self, model, batch):
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets, label_smoothing=self.label_smoothing)

    def eval_sums(self, model, batch):
        inputs, targets = batch
        logits = model(inputs)
        top_two = (logits.topk(2, dim=-1).indices == targets[:, None]).any(-1)
        return {"loss_sum": F.cross_entropy(logits, targets, reduction="sum"), "top_two": top_two.sum(),
                "count": torch.tensor(len(targets))}

    def summarize(self, sums):
        return {"loss": sums["loss_sum"] / sums["count"], "top2_accuracy": sums["top_two"] / sums["count"]}


class CountingCompiles:
    """Next-token prediction that notes, before each training step's loss and each evaluation batch: the frames
    Dynamo has compiled so far, its graph breaks, and how many GPT blocks ran as Python (``EAGER_BLOCKS``: a block
    inside a compiled graph does not run its Python at all). For tests/train/test_compile_counters.py."""

    seen: list[tuple[str, int, int, int]] = []  # (train or eval, frames compiled, graph breaks, blocks run eagerly)

    def __init__(self):
        from hydraddp.train.tasks import CausalLM

        self.inner = CausalLM()

    def _note(self, phase: str) -> None:
        from torch._dynamo.utils import counters

        self.seen.append((phase, counters["frames"]["total"], sum(counters["graph_break"].values()), EAGER_BLOCKS[0]))

    def loss(self, model, batch):
        self._note("train")
        return self.inner.loss(model, batch)

    def eval_sums(self, model, batch):
        self._note("eval")
        return self.inner.eval_sums(model, batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


EAGER_BLOCKS = [0]


def count_eager_blocks() -> None:
    """Make every GPT block count the times its Python runs outside a Dynamo trace."""
    import torch

    from hydraddp.models.gpt import GPTBlock

    forward = GPTBlock.forward
    if getattr(forward, "counts_eager", False):
        return

    def counted(self, x):
        if not torch.compiler.is_compiling():
            EAGER_BLOCKS[0] += 1
        return forward(self, x)

    counted.counts_eager = True
    GPTBlock.forward = counted


class Paced(TopTwo):
    """Classification that takes at least ``step_s`` seconds a step, so that a test can act mid-run (kill a node)
    on a machine where the real step takes a millisecond."""

    def __init__(self, step_s: float = 0.05):
        super().__init__()
        self.step_s = step_s

    def loss(self, model, batch):
        import time

        time.sleep(self.step_s)
        return super().loss(model, batch)


class RaisesAt(TopTwo):
    """Classification whose step ``step`` raises: a worker failing mid-run."""

    def __init__(self, step: int = 2):
        super().__init__()
        self.step, self.calls = step, 0

    def loss(self, model, batch):
        self.calls += 1
        if self.calls == self.step:
            raise RuntimeError(f"the user's task failed at step {self.step}")
        return super().loss(model, batch)
