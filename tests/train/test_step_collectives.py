"""What a training step that logs nothing sends between the ranks: the gradient reduction, and nothing else. Each
step's collectives are counted by torch's ``CommDebugMode`` (every c10d and functional collective through the
dispatcher), from one ``train_step`` to the next, in a real 2-rank gloo group running ``train()``. Once every
``checkpoint.preempt_check_every`` steps the ranks also agree on a stop signal: one all-reduce, of a host flag."""

from __future__ import annotations

from collections import Counter


CHECK_EVERY, STEPS = 5, 14


def collectives_per_step(local_rank: int, cases: dict[str, list[str]]) -> dict:
    """``train()`` of each config; for each step, the collectives issued from its ``train_step`` to the next one's
    (the c10d ops and functional collectives that pass torch's dispatcher, by name)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hydraddp.config.compose import compose
    from hydraddp.train import loop

    class Collectives(TorchDispatchMode):
        def __init__(self, counts: Counter):
            super().__init__()
            self.counts = counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                self.counts[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    out = {}
    plain_step = loop.train_step
    for name, overrides in cases.items():
        steps: list[Counter] = []
        window: list[Collectives] = []

        def counted_step(*args, **kwargs):
            if window:  # the previous step's window ends where this step begins
                window.pop().__exit__(None, None, None)
            steps.append(Counter())
            window.append(Collectives(steps[-1]))
            window[-1].__enter__()
            return plain_step(*args, **kwargs)

        loop.train_step = counted_step
        try:
            loop.train(compose(overrides))
        finally:
            loop.train_step = plain_step
            if window:
                window.pop().__exit__(None, None, None)
        out[name] = [dict(counts) for counts in steps]
    return out


SMALL = ["backend=gloo", "model.hidden=[32,32]", "data.batch_size=16", f"trainer.max_steps={STEPS}",
         "trainer.log_every=1000", "trainer.eval_every=0", "tracking.enabled=false",
         f"checkpoint.preempt_check_every={CHECK_EVERY}", "plan.measure=false"]


def test_a_step_that_logs_nothing_sends_the_gradient_reduction_alone(pools):
    out = pools.run("tests.train.test_step_collectives:collectives_per_step", {
        "ddp": [*SMALL, "wrap=ddp"],  # clipping on (1.0): the gradients are whole on every rank, nothing is sent
        "fsdp2": [*SMALL, "wrap=fsdp2", "trainer.grad_clip=null"],  # (clipping sharded gradients adds a norm's)
    })[0]
    # Step 1 (the report's gathers) and the last (the logged step, the final evaluation) do more; every other step is
    # what a long run repeats.
    quiet = range(3, STEPS)
    # The step's own collectives: DDP's all-reduce of its one gradient bucket; FSDP2's all-gathers of each unit's
    # parameters (forward and backward) and reduce-scatters of its gradients.
    reduction = {"ddp": {"allreduce_"}, "fsdp2": {"_allgather_base_", "_reduce_scatter_base_"}}
    for wrap, ops in reduction.items():
        usual = Counter(out[wrap][3 - 1])
        assert set(usual) == ops, (wrap, out[wrap])
        for step in quiet:
            extra = Counter(out[wrap][step - 1])
            extra.subtract(usual)
            assert +extra == Counter({"allreduce_": 1} if step % CHECK_EVERY == 0 else {}), (wrap, step, out[wrap])
            assert not -extra, (wrap, step, out[wrap])
