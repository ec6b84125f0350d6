"""What only the model of the config can tell before a launch: the checkpoint a resume starts from holds it,
``model.pretrained`` is what it says and fits it (a Hugging Face directory also gives it its sizes), its
initialization can be replayed after sharding (``model.init_device=meta``), and its TP plan splits as ``mesh.tp``
says. Built on the meta device (``models.of_config``): no memory, no process group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hydraddp.parallel.combinations import Problem
from hydraddp.tracking import names


def resume_after_preemption(cfg: DictConfig, job_dir: Path) -> int:
    """A launch in the job directory of a preempted one (a requeued job, or a rerun with ``hydra.run.dir``) goes on
    from its checkpoint. Returns how many preemptions the job has had (0: none)."""
    from hydraddp.handoff.preemption import resume_point

    checkpoint, preemptions = resume_point(job_dir)
    if checkpoint and not cfg.checkpoint.resume:
        cfg.checkpoint.resume = checkpoint
    return preemptions


def resume_problems(cfg: DictConfig, job_dir: Path) -> tuple[list[Problem], dict[str, Any] | None]:
    """Find ``checkpoint.resume`` and check it holds the model of this config (``models.of_config``, on the meta
    device: no memory, no process group). A resumed run continues its MLflow run unless told otherwise. Returns the
    problems and where the resume starts."""
    if not cfg.checkpoint.resume:
        return [], None
    from hydraddp.models.of_config import model_of
    from hydraddp.handoff.checkpoints import CheckpointError, check_matches, check_readable, find, read_meta

    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else job_dir / "checkpoints"
    try:
        path = find(root, cfg.checkpoint.resume)
        meta = read_meta(path)
        check_readable(path)
        check_matches(path, {"model": model_of(cfg.model).state_dict()})
    except CheckpointError as exc:
        return [Problem(("checkpoint.resume",), str(exc), "")], None
    cfg.checkpoint.resume = str(path.resolve())
    run_id_file = Path(meta["job_dir"], names.RUN_ID_FILE) if meta.get("job_dir") else None
    run_id = meta.get("run_id") or (run_id_file.read_text().strip() if run_id_file and run_id_file.exists() else None)
    if not cfg.tracking.run_id and run_id:
        cfg.tracking.run_id = run_id
    return [], {"checkpoint": cfg.checkpoint.resume, "step": meta["step"]}


def pretrained_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    """``model.pretrained``: what it is, made an absolute path (the workers' and the run's), and for a Hugging Face
    directory the model's sizes from its ``config.json``, in ``cfg.model`` (so every check after this one, and the
    run's parameters, see the model that will train). Again on the same config, it changes nothing."""
    pretrained = cfg.model.get("pretrained")
    if not pretrained:
        return []
    from hydraddp.models import hf
    from hydraddp.handoff.pretrained import kind

    try:
        source = kind(pretrained)
        cfg.model.pretrained = pretrained = str(Path(pretrained).resolve())
        if source == "hf":
            if cfg.model.get("_target_") != hf.HF_TARGET:
                raise hf.PretrainedError(
                    f"model.pretrained={pretrained} is a Hugging Face model directory, which only a transformers "
                    f"model loads (model=hf_causal_lm); model._target_ is {cfg.model.get('_target_')}.")
            hf.from_hf_config(cfg.model, Path(pretrained), hf.typed_model_keys(overrides))
    except hf.PretrainedError as exc:
        return [Problem(("model.pretrained",), str(exc), "")]
    return []


def model_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    """What only building the model of the config can tell, on the meta device (no memory, no process group), and
    only when asked: ``model.pretrained`` fits the model (``pretrained_problems`` first), under
    ``model.init_device=meta`` the model's initialization can be replayed after sharding, and under ``mesh.tp > 1``
    the model has a TP plan whose splits ``mesh.tp`` divides."""
    found = pretrained_problems(cfg, overrides)
    pretrained, meta = cfg.model.get("pretrained"), cfg.model.get("init_device") == "meta"
    tp = cfg.mesh.tp if cfg.wrap.name == "fsdp2" and cfg.mesh.tp > 1 else 1
    pp = OmegaConf.select(cfg, "mesh.pp", default=1)
    if found or (not pretrained and not meta and tp == 1 and pp == 1):
        return found  # the usual case: no torch import before the tracker starts
    from hydraddp.parallel import meta_init
    from hydraddp.models.of_config import model_factory, model_of
    from hydraddp.handoff import pretrained as weights

    try:
        model = meta_init.build_on_meta(model_factory(cfg.model))[0] if meta else model_of(cfg.model)
    except meta_init.NotReplayable as exc:
        return [Problem(("model.init_device",), f"model.init_device=meta: {exc}.",
                        "Set model.init_device=cpu (built whole on every rank) or auto (whole, with a warning).")]
    wrong = pretrained and weights.mismatch(Path(pretrained), weights.kind(pretrained), model)
    if wrong:
        return [Problem(("model.pretrained",), f"model.pretrained={pretrained} does not fit this model: {wrong}. "
                        "Start from weights of the same architecture and sizes.", "")]
    if pp > 1:  # the model's blocks, cut into the stages asked for
        found = _pipeline_problems(cfg, model)
    if tp > 1 and not found:  # the model's plan, and every size it splits, against mesh.tp
        from hydraddp.build import tp_kwargs
        from hydraddp.parallel.tp import tp_problems

        found = tp_problems(model, tp, tp_kwargs(cfg).get("tp_plan"))
    return found


def _pipeline_problems(cfg: DictConfig, model: Any) -> list[Problem]:
    """The model has a pipeline shape, and its blocks cut into the stages asked for (``mesh.pp_split`` if given)."""
    from hydraddp.parallel.pipeline import NotPipelinable, block_sizes, cut, stages_per_rank_of

    try:
        stages = cfg.mesh.pp * stages_per_rank_of(cfg.mesh.pp_schedule, cfg.mesh.pp_stages_per_rank)
        split = list(cfg.mesh.pp_split) if cfg.mesh.pp_split else None
        cut(block_sizes(model), stages, split)
    except NotPipelinable as exc:
        return [Problem(("mesh.pp", "model"), f"mesh.pp={cfg.mesh.pp}: {exc}.",
                        "Use a model with a pipeline_shape (model=gpt), fewer stages, or mesh.pp=1.")]
    return []
