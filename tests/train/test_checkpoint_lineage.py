"""Checkpoints name the launch that wrote them: a step the same launch writes again is replaced, another launch's is
never written over (refused before the launch starts, also while that launch is still running), and a restart
resumes its own launch's latest checkpoint, not the newest in a shared ``checkpoint.dir``. The in-process checks use
DCP's single-process save and load; a publish refused on rank 0 is checked in a reused 2-rank gloo group."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import hydraddp.distributed as idist
from hydraddp.handoff import checkpoints
from hydraddp.train import checkpoint, resume
from tests.helpers.spawn import NO_PLAN, UNTRACKED, job_dirs, run_cli, run_together

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")


def model_and_optimizer(fill: float):
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def save(root, step, fill, launch, keep_last=0):
    model, optimizer = model_and_optimizer(fill)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.save(root, step, model, optimizer, {"job_dir": launch}, keep_last=keep_last)


def loaded_weight(path) -> float:
    model, optimizer = model_and_optimizer(0.0)
    checkpoint.load(path, model, optimizer)
    return model.weight[0, 0].item()


def test_a_step_the_same_launch_writes_again_is_replaced_and_another_launchs_is_refused(tmp_path):
    path = save(tmp_path, 4, 1.0, "/jobs/a")
    assert save(tmp_path, 4, 2.0, "/jobs/a") == path  # once ENOTEMPTY: a rerun in the same job directory
    assert loaded_weight(path) == 2.0 and sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]
    with pytest.raises(checkpoints.CheckpointError, match=r"written by another launch \(/jobs/a\)"):
        save(tmp_path, 4, 3.0, "/jobs/b")
    assert loaded_weight(path) == 2.0


def test_keep_last_prunes_only_the_launchs_own_checkpoints(tmp_path):
    save(tmp_path, 2, 1.0, "/jobs/a")  # the checkpoint launch b resumed from
    for step in (4, 6, 8):
        save(tmp_path, step, 1.0, "/jobs/b", keep_last=2)
    assert [p.name for p in checkpoints.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000006",
                                                                          "step_00000008"]
    assert [checkpoints.step_of(p) for p in checkpoints.complete_checkpoints(tmp_path, launch="/jobs/b")] == [6, 8]


def test_a_restart_resumes_its_own_launchs_latest_not_the_newest_in_the_folder(tmp_path, monkeypatch):
    save(tmp_path, 4, 4.0, "/jobs/a")
    save(tmp_path, 8, 8.0, "/jobs/other")  # newer, by another launch sharing checkpoint.dir
    cfg = OmegaConf.create({"checkpoint": {"dir": str(tmp_path), "resume": None}, "wrap": {"name": "ddp"}})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    model, optimizer = model_and_optimizer(0.0)
    resumed = resume.resume(cfg, "/jobs/a", model, optimizer, None, None)
    assert resumed.step == 4 and model.weight[0, 0].item() == 4.0
    assert checkpoints.others_ahead(tmp_path, "/jobs/a", 0) == [tmp_path / "step_00000008"]
    assert checkpoints.others_ahead(tmp_path, "/jobs/a", 8) == []


@pytest.mark.slow
def test_a_launch_that_would_write_over_another_launchs_checkpoints_exits_2_and_a_rerun_replaces_its_own(tmp_path):
    quick = ["trainer.max_steps=12", "trainer.eval_every=0", "checkpoint.every_n_steps=6", NO_PLAN, UNTRACKED]
    first = run_cli("hydra.run.dir=job", *quick, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    root = tmp_path / "job" / "checkpoints"
    written = json.loads((root / "step_00000012" / "meta.json").read_text())
    assert written["job_dir"] == str(tmp_path / "job") and written["resumed_from"] is None
    # A new launch into that checkpoint.dir, and a resume from step 6 there (step 12 is ahead): each would write
    # step 12 over the first launch's (it once crashed with ENOTEMPTY at that save, after training to it).
    for extra in ([], [f"checkpoint.resume={root / 'step_00000006'}"]):
        refused = run_cli(f"checkpoint.dir={root}", *extra, *quick, cwd=tmp_path / "other", timeout=60)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"checkpoint.dir={root} holds" in refused.stderr and "step_00000012" in refused.stderr
        assert "Point checkpoint.dir at a new directory" in refused.stderr and "Traceback" not in refused.stderr
        assert job_dirs(tmp_path / "other") == []  # nothing half-written
    # A rerun in the same job directory is the same launch: it replaces its own steps.
    rerun = run_cli("hydra.run.dir=job", *quick, "optim.optimizer.lr=0.01", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rewritten = json.loads((root / "step_00000012" / "meta.json").read_text())
    assert rewritten["config"]["optim"]["optimizer"]["lr"] == 0.01 != written["config"]["optim"]["optimizer"]["lr"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006", "step_00000012"]


def publish_over_another_launch(local_rank: int, root: str, background: bool) -> tuple[str, int]:
    """A pool body: save step 5 where another launch's step 5 appeared meanwhile (rank 0's rename refuses it). What
    this rank raised, and an all-reduce after it: the ranks are still in step."""
    from tests.distributed.workers import mlp

    model = idist.auto_model(mlp(), wrap="fsdp2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    if idist.get_rank() == 0:
        other = checkpoints.step_dir(Path(root), 5)
        other.mkdir(parents=True)
        (other / checkpoints.META).write_text(json.dumps({"job_dir": "/jobs/other", "step": 5}))
    idist.barrier()
    try:
        saved = checkpoint.save(Path(root), 5, model, optimizer, {"job_dir": "/jobs/mine"}, background=background)
        if isinstance(saved, checkpoint.PendingSave):
            if idist.get_rank() == 0:
                saved.publish()  # as training does once rank 0's own write is done, alone: no collective, no raise
            saved.finish()
        raised = ""
    except checkpoints.CheckpointError as exc:
        raised = str(exc)
    return raised, idist.all_reduce(1)


@pytest.mark.parametrize("background", [False, True], ids=["at_once", "in_the_background"])
def test_a_publish_refused_on_rank_0_fails_the_save_on_every_rank(pools, tmp_path, background):
    # Once rank 0 alone raised: at once, the other rank waited in the barrier after the rename for ever; in the
    # background, it went on training as if the checkpoint were written. Rank 0's early publish (training goes on,
    # ranks see their writes done at different steps) raises nothing until every rank finishes together.
    out = pools.run("tests.train.test_checkpoint_lineage:publish_over_another_launch", str(tmp_path), background,
                    timeout=60)
    for rank in (0, 1):
        raised, ranks = out[rank]
        assert "written by another launch (/jobs/other)" in raised and ranks == 2, (rank, out)
    assert checkpoints.written_by(tmp_path / "step_00000005") == "/jobs/other"


@pytest.mark.slow
def test_two_launches_into_one_checkpoint_dir_at_once_keep_one_intact_and_refuse_the_other(tmp_path):
    """Both once passed the check of the folder at their start, then wrote the same steps: one died at a rename
    ("exists, written by another launch"), its own checkpoints gone. Now the first to claim the folder trains;
    the other exits 2 before any worker starts."""
    shared = tmp_path / "shared"
    quick = ["trainer.max_steps=10", "trainer.log_every=1", "trainer.eval_every=0", "checkpoint.every_n_steps=5",
             f"checkpoint.dir={shared}", NO_PLAN, UNTRACKED]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    launched = run_together([([sys.executable, "-m", "hydraddp", *quick], tmp_path / name) for name in ("a", "b")],
                            timeout=240)
    assert sorted(done.returncode for done in launched) == [0, 2], [done.stderr[-3000:] for done in launched]
    won, refused = sorted(zip(launched, "ab"), key=lambda pair: pair[0].returncode)
    [job] = job_dirs(tmp_path / won[1])
    assert f"checkpoint.dir={shared} is in use by another launch that is running now (job_dir {job}" in refused[0].stderr
    assert "Give this launch its own checkpoint.dir" in refused[0].stderr and "Traceback" not in refused[0].stderr
    assert job_dirs(tmp_path / refused[1]) == []  # nothing trained, nothing half-written
    # The winner's checkpoints are whole and its own; the claim went with the launch.
    assert sorted(p.name for p in shared.iterdir()) == ["step_00000005", "step_00000010"]
    for path in checkpoints.complete_checkpoints(shared):
        assert checkpoints.written_by(path) == str(job) and checkpoints.check_readable(path)
