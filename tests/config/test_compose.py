"""Every group option and every experiment composes; the schema catches misspelled keys and wrong types."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ValidationError

from hydraddp.config.compose import CONF_DIR, compose
from hydraddp.config.instantiate import instantiate, model_kwargs

REPO = Path(__file__).resolve().parents[2]
GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONF_DIR.iterdir()) if group.is_dir() and group.name != "experiment"
    for option in sorted(group.glob("*.yaml"))
]
EXPERIMENTS = sorted(p.stem for p in (REPO / "experiments").glob("*.yaml"))

CONTRACT = {
    "backend": {"auto", "gloo", "nccl", "mpi", "horovod", "none"},
    "wrap": {"auto", "none", "dp", "ddp", "fsdp", "fsdp2"},
    "precision": {"fp32", "bf16", "fp16", "bf16-true"},
    "offload": {"none", "cpu"},
}


def test_the_contract_groups_have_exactly_the_contract_options():
    for group, options in CONTRACT.items():
        assert {o for g, o in GROUP_OPTIONS if g == group} == options


def test_all_groups_exist():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert groups == {"backend", "wrap", "precision", "offload", "launcher", "model", "task", "data", "optim",
                      "trainer", "tracking", "checkpoint"}


@pytest.mark.parametrize("group, option", GROUP_OPTIONS)
def test_every_group_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    if group in CONTRACT:
        assert cfg[group].name == option


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_starts_with_its_usage(name):
    first_line = (REPO / "experiments" / f"{name}.yaml").read_text().splitlines()[0]
    assert first_line.startswith("# python -m hydraddp") and f"experiment={name}" in first_line
    cfg = compose([f"experiment={name}"], return_hydra_config=True)
    assert cfg.trainer.max_steps > 0


def test_experiments_are_global_deltas():
    gpt = compose(["experiment=gpt_fsdp2"])
    assert (gpt.wrap.name, gpt.precision.name, gpt.model._target_) == ("fsdp2", "bf16", "hydraddp.models.gpt.GPT")
    assert gpt.model.seq_len == gpt.data.seq_len == 64
    sweep = compose(["experiment=wrap_sweep"], return_hydra_config=True)
    assert dict(sweep.hydra.sweeper.params) == {"wrap": "ddp,fsdp,fsdp2", "precision": "fp32,bf16"}


def torchvision_loads() -> bool:
    from hydraddp.models.vision import _torchvision

    try:
        _torchvision()
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("group", ["model", "data", "optim"])
def test_every_target_option_instantiates(group):
    import torch

    for option in [o for g, o in GROUP_OPTIONS if g == group]:
        cfg = compose([f"{group}={option}", *(["data=text"] if option == "gpt" else [])])
        if group == "model" and option == "resnet18" and not torchvision_loads():
            continue  # tests/vision builds it, in the venv whose torchvision matches its torch
        if group == "model":
            assert isinstance(instantiate(model_kwargs(cfg.model), "model"), torch.nn.Module)
        elif group == "data":
            train, evaluation = instantiate(cfg.data.dataset, "data.dataset")
            assert len(train) > len(evaluation) > 0
        else:
            optimizer = instantiate(cfg.optim.optimizer, "optim.optimizer")([torch.nn.Parameter(torch.ones(1))])
            assert isinstance(optimizer, torch.optim.Optimizer)


def test_misspelled_key_and_wrong_type_fail_at_compose_time():
    with pytest.raises(ConfigCompositionException) as misspelled:
        compose(["trainer.max_stpes=3"])
    assert isinstance(misspelled.value.__cause__, ConfigAttributeError)  # "Key not in TrainerConfig"
    with pytest.raises(ConfigCompositionException) as wrong_type:
        compose(["launcher.nnodes=two"])
    assert isinstance(wrong_type.value.__cause__, ValidationError)


def test_digits_are_read_from_scikit_learns_package_data():
    from hydraddp.data.digits import digits

    train, evaluation = digits()
    assert len(train) + len(evaluation) == 1797
    x, y = train[0]
    assert x.shape == (64,) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0 and 0 <= int(y) <= 9


def test_a_new_target_starts_a_new_node_instead_of_inheriting_the_options_keys():
    cfg = compose(["model._target_=torch.nn.Linear", "model.in_features=64", "model.out_features=10"])
    assert dict(cfg.model) == {"_target_": "torch.nn.Linear", "in_features": 64, "out_features": 10}
    assert isinstance(instantiate(model_kwargs(cfg.model), "model"), __import__("torch").nn.Linear)
    # choosing an option and changing one key still merges, as Hydra does
    assert compose(["model=gpt", "model.depth=1"]).model.dim == compose(["model=gpt"]).model.dim
    task = compose(["task._target_=tests.train.user_task.TopTwo", "task.label_smoothing=0.1"]).task
    assert dict(task) == {"_target_": "tests.train.user_task.TopTwo", "label_smoothing": 0.1}
