"""Pipeline parallel (issue 56, its core): a model cut along its blocks, each rank running its stages under torch's own
schedules, on real gloo ranks. Its losses and its parameters after 10 SGD steps are one process's (1e-5, fp32), under
1F1B and GPipe at pp=2, with FSDP2 over the data-parallel ranks of each stage (pp=2 x dp_shard=2), at pp=4, and under
Interleaved1F1B with 2 stages per rank; every stage keeps its blocks' own names, so a checkpoint written at
pp=2 x dp_shard=2 resumes under FSDP2 at dp_shard=4 and ends where one process does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pathlib import Path

from hydraddp.models.gpt import GPT
from hydraddp.parallel.pipeline import NotPipelinable, cut, shape_of, stage_ids, stage_module, stages_per_rank_of
from tests.parallel.test_meta_init import SEED, token_batches, trained

DEPTH = 4


def small_gpt() -> GPT:
    return GPT(vocab_size=64, seq_len=16, dim=32, depth=DEPTH, heads=2)


def causal_lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def test_the_cut_balances_parameters_or_follows_the_split_given():
    assert cut([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert cut([4, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]  # the largest stage as small as it can be
    assert cut([1, 1, 1, 1], 4) == [range(i, i + 1) for i in range(4)]
    assert cut([1, 1, 1, 1], 2, split=[3]) == [range(0, 3), range(3, 4)]
    with pytest.raises(NotPipelinable, match="3 stages need at least 3 blocks, and the model has 2"):
        cut([1, 1], 3)
    with pytest.raises(NotPipelinable, match=r"the split \[0\] is not 1 increasing block indices"):
        cut([1, 1, 1], 2, split=[0])


def test_stages_go_one_per_rank_looped_or_in_a_v():
    assert [stage_ids(r, 2, "1F1B") for r in range(2)] == [[0], [1]]
    assert [stage_ids(r, 2, "Interleaved1F1B", 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids(r, 2, "ZBVZeroBubble", 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert stages_per_rank_of("GPipe", 4) == 1 and stages_per_rank_of("DualPipeV", 1) == 2
    with pytest.raises(NotPipelinable, match="pp_stages_per_rank=1; give 2 or more"):
        stages_per_rank_of("Interleaved1F1B", 1)
    with pytest.raises(NotPipelinable, match="pp_schedule=2F2B is not one of torch's schedules"):
        stages_per_rank_of("2F2B", 1)


def test_a_stage_keeps_its_blocks_names_and_only_the_ends_it_holds():
    model = small_gpt()
    first = stage_module(model, shape_of(model), range(0, 2), first=True, last=False)
    last = stage_module(model, shape_of(model), range(2, 4), first=False, last=True)
    assert list(first.blocks) == ["0", "1"] and first.head is None and first.tok_emb is not None
    assert list(last.blocks) == ["2", "3"] and last.tok_emb is None and last.head is not None
    whole = set(model.state_dict())
    assert set(first.state_dict()) | set(last.state_dict()) == whole
    assert not set(first.state_dict()) & set(last.state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    assert torch.equal(last(first(tokens)), model(tokens))  # the stages in a row are the model


def test_a_model_without_a_pipeline_shape_is_refused_with_the_reason():
    with pytest.raises(NotPipelinable, match="MLP declares no pipeline_shape"):
        from hydraddp.models.mlp import MLP

        shape_of(MLP())


def pipelined(local_rank: int, schedule: str, pp: int, dp: int, stages_per_rank: int, microbatches: int,
              steps: int = 10, save_to: str | None = None) -> dict:
    """``steps`` SGD steps of the small GPT over a (pp, dp_shard) mesh: the global losses, this rank's stages' full
    parameters after them, and (``save_to``) the checkpoint written then."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hydraddp.parallel.layout import Layout
    from hydraddp.parallel.parallelize import parallelize
    from hydraddp.parallel.pipeline import build
    from hydraddp.parallel.precision import precision_spec
    from hydraddp.train import checkpoint
    from tests.distributed.workers import full_params

    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp_shard"))
    cpu = torch.device("cpu")

    def parallelize_stage(stage: nn.Module) -> nn.Module:
        if dp == 1:
            return stage
        layout = Layout.of(stage, "fsdp2", precision_spec("fp32"), cpu, dp, mesh=mesh["dp_shard"])
        return parallelize(stage, layout)[0]

    torch.manual_seed(SEED)
    pipe = build(small_gpt(), mesh["pp"], schedule, microbatches, causal_lm_loss, cpu, parallelize_stage,
                 stages_per_rank=stages_per_rank)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    dp_rank, losses = mesh["dp_shard"].get_local_rank(), []
    for batch in token_batches()[:steps]:
        share = batch.chunk(dp)[dp_rank]
        loss = pipe.step(share, share)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss, group=mesh["dp_shard"].get_group())
        losses.append(loss.item() / dp)
    saved = str(checkpoint.save(Path(save_to), steps, pipe.stages[0], optimizer, {"config": {}})) if save_to else None
    params = {}
    for stage in pipe.stages:
        params.update({k: v.cpu() for k, v in full_params(stage).items()})
    return {"losses": losses, "params": params, "stages": pipe.stage_indices, "saved": saved}


def resumed_under_fsdp2(local_rank: int, path: str, steps_done: int) -> dict:
    """The small GPT under FSDP2 over every rank, resumed from ``path``, trained over the batches after
    ``steps_done``: the global losses and the full parameters."""
    import hydraddp.distributed as idist
    from hydraddp.train import checkpoint
    from tests.distributed.workers import full_params

    torch.manual_seed(99)  # other weights than the checkpoint's, so that the load shows
    world = idist.get_world_size()
    model = idist.auto_model(small_gpt(), wrap="fsdp2", mesh_shape=(1, world, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # its momentum comes from the checkpoint
    checkpoint.load(Path(path), model, optimizer)
    losses = []
    for batch in token_batches()[steps_done:]:
        loss = causal_lm_loss(model(batch.chunk(world)[idist.get_rank()]), batch.chunk(world)[idist.get_rank()])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(idist.all_reduce(loss.detach())) / world)
    return {"losses": losses, "params": {k: v.cpu() for k, v in full_params(model).items()}}


@pytest.mark.parametrize("schedule, pp, dp, stages_per_rank, microbatches", [
    ("1F1B", 2, 1, 1, 4),
    ("GPipe", 2, 1, 1, 2),
    ("1F1B", 2, 2, 1, 2),  # pp=2 x dp_shard=2: FSDP2 over each stage's two replicas of the pipeline
    ("1F1B", 4, 1, 1, 4),
    ("Interleaved1F1B", 2, 1, 2, 4),
])
def test_a_pipeline_trains_as_one_process(pools, schedule, pp, dp, stages_per_rank, microbatches):
    torch.manual_seed(SEED)
    expected_losses, whole = trained("gpt", small_gpt())
    expected = whole.state_dict()
    out = pools.run("tests.parallel.test_pipeline:pipelined", schedule, pp, dp, stages_per_rank, microbatches,
                    nproc=pp * dp)
    held = {}
    for rank, seen in out.items():
        assert seen["losses"] == pytest.approx(expected_losses, abs=1e-5), (rank, seen["losses"], expected_losses)
        held.update(seen["params"])
    assert set(held) == set(expected)  # every parameter on some stage, under its own name
    worst = max((held[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, worst
    assert sorted(i for seen in out.values() for i in seen["stages"]) == sorted(
        i for i in range(pp * stages_per_rank) for _ in range(dp))


def test_a_checkpoint_written_at_pp2_x_dp2_resumes_under_fsdp2_at_dp4_and_ends_as_one_process(pools, tmp_path):
    torch.manual_seed(SEED)
    expected_losses, whole = trained("gpt", small_gpt())
    expected = whole.state_dict()
    first = pools.run("tests.parallel.test_pipeline:pipelined", "1F1B", 2, 2, 1, 2, 5, str(tmp_path), nproc=4)
    path = first[0]["saved"]
    assert path and all(seen["saved"] == path for seen in first.values())
    second = pools.run("tests.parallel.test_pipeline:resumed_under_fsdp2", path, 5, nproc=4)
    for rank in range(4):
        losses = first[rank]["losses"] + second[rank]["losses"]
        assert losses == pytest.approx(expected_losses, abs=1e-5), (rank, losses, expected_losses)
    worst = max((second[0]["params"][k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, worst



def test_the_bubble_is_the_share_of_a_step_its_stages_did_not_compute(monkeypatch):
    """On a clock the test moves: a step of 4 s in which the stage computed 1 s forward and 2 s backward has a bubble
    of 1/4. (The measured bubble of a real pipeline depends on the machine's load: benchmarks measure it, tests do
    not time anything.)"""
    from hydraddp.parallel import pipeline

    clock = [0.0]
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: clock[0])

    class Stage:
        def forward_one_chunk(self, *args):
            clock[0] += 1

        def backward_one_chunk(self, *args):
            clock[0] += 2

        backward_weight_one_chunk = backward_one_chunk

    computing = [0.0]
    stage = pipeline._timed(Stage(), computing)

    class Schedule:
        def step(self, *args, target=None, losses=None):
            clock[0] += 1  # waiting for the other stage
            stage.forward_one_chunk(0)
            stage.backward_one_chunk(0)
            losses.append(torch.tensor(2.0))

    group = None
    pipe = pipeline.Pipeline([], [0], 1, Schedule(), group, {0: 0}, computing)
    monkeypatch.setattr(pipeline.dist, "broadcast", lambda tensor, src, group: None)
    assert pipe.step(torch.zeros(1), torch.zeros(1)).item() == 2.0
    assert pipe.bubble == pytest.approx(0.25) and computing == [3.0]


def bubbles(local_rank: int, microbatches: int, steps: int) -> list[float]:
    """Each step's bubble on this rank: 1F1B, 2 stages, ``microbatches`` of 4 sequences."""
    from torch.distributed.device_mesh import init_device_mesh

    from hydraddp.parallel.pipeline import build

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    torch.manual_seed(SEED)
    pipe = build(small_gpt(), mesh["pp"], "1F1B", microbatches, causal_lm_loss, torch.device("cpu"),
                 lambda stage: stage)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    seen = []
    for step in range(steps):
        batch = torch.randint(0, 64, (4 * microbatches, 16), generator=torch.Generator().manual_seed(step))
        pipe.step(batch, batch)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(pipe.bubble)
    return seen


def test_every_rank_measures_the_bubble_of_every_step(pools):
    out = pools.run("tests.parallel.test_pipeline:bubbles", 8, 3)
    assert all(len(seen) == 3 and all(0 <= b < 1 for b in seen) for seen in out.values()), out
