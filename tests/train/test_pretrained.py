"""model.pretrained and export --format hf: a Llama saved by transformers' own ``save_pretrained`` is loaded into the
shards of every wrap and gives transformers' own loss; a bf16 file fills fp32 master weights; tied embeddings come
through; a hydraddp checkpoint starts another model's run; what does not fit is refused before any worker starts; and
a trained checkpoint goes back out as a directory ``from_pretrained`` loads, equal to the checkpoint tensor for tensor."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hydraddp.config.compose import compose
from hydraddp.preflight.model import model_problems
from tests.helpers.spawn import job_dirs, run_cli, run_process

# Sizes unlike hf_causal_lm.yaml's (hidden 64, 2 layers): the run must take them from config.json.
SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 5000.0}
WRAPS = ["none", "ddp", "fsdp", "fsdp2"]
SMALL_DATA = ["data.dataset.num_chars=6000", "data.eval_batch_size=16"]


def save_llama(folder: Path, dtype: torch.dtype = torch.float32, tie: bool = False) -> Path:
    import transformers

    torch.manual_seed(11)
    config = transformers.AutoConfig.for_model("llama", tie_word_embeddings=tie, **SIZES)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    return {"fp32": save_llama(root / "fp32"), "bf16": save_llama(root / "bf16", torch.bfloat16),
            "tied": save_llama(root / "tied", tie=True)}


def config_for(path: Path, wrap: str, extra: list[str] = ()):
    cfg = compose(["model=hf_causal_lm", f"model.pretrained={path}", f"wrap={wrap}", *SMALL_DATA, *extra])
    assert model_problems(cfg, list(extra)) == []  # as the launch does: the sizes come from config.json
    return cfg


def eval_loss(model, cfg) -> float:
    from hydraddp.train import data
    from hydraddp.train.evaluation import evaluate
    from hydraddp.config.instantiate import instantiate

    _, eval_set = instantiate(cfg.data.dataset, "data.dataset")
    loader = data.eval_loader(eval_set, cfg.data.eval_batch_size, 0)
    return evaluate(model, loader, torch.device("cpu"), instantiate(cfg.task, "task")).metrics["loss"]


def transformers_loss(path: Path) -> float:
    """transformers' own model of ``path`` (``from_pretrained``, fp32), on the eval windows."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return eval_loss(model, config_for(path, "none"))


def loaded_under_each_wrap(local_rank: int, cases: list[tuple[str, str]]) -> dict:
    """Per (file, wrap): the eval loss of the model built and wrapped as a launch does, then filled from the file, with
    where it was built and the dtype of its parameters."""
    from hydraddp.build import build_model
    from hydraddp.train import pretrained

    out = {}
    for path, wrap in cases:
        cfg = config_for(Path(path), wrap)
        model, report = build_model(cfg)
        pretrained.load(cfg.model.pretrained, model)
        dtypes = {str(p.dtype) for p in model.parameters()}
        out[f"{Path(path).name}-{wrap}"] = {"loss": eval_loss(model, cfg), "init_device": report.init_device,
                                            "wrapper": report.wrapper, "dtypes": sorted(dtypes)}
    return out


def test_a_save_pretrained_llama_gives_transformers_own_loss_under_every_wrap(pools, saved):
    cases = [(str(saved["fp32"]), w) for w in WRAPS] + [(str(saved["bf16"]), "fsdp2"), (str(saved["tied"]), "fsdp2"),
                                                         (str(saved["tied"]), "ddp")]
    out = pools.run("tests.train.test_pretrained:loaded_under_each_wrap", cases)
    expected = {name: transformers_loss(saved[name]) for name in saved}
    for rank in (0, 1):
        for path, wrap in cases:
            name = Path(path).name
            seen = out[rank][f"{name}-{wrap}"]
            assert math.isclose(seen["loss"], expected[name], abs_tol=1e-4), (rank, name, wrap, seen, expected[name])
            assert seen["wrapper"] == wrap and seen["dtypes"] == ["torch.float32"], (rank, name, wrap, seen)
    # Built on the meta device under the FSDPs (nothing whole before sharding); the tied model whole, as it must be.
    assert out[0]["fp32-fsdp2"]["init_device"] == out[0]["fp32-fsdp"]["init_device"] == "meta"
    assert out[0]["tied-fsdp2"]["init_device"] == "cpu"


def test_the_pretrained_config_sets_the_sizes_and_a_contradicting_one_typed_is_refused(saved):
    cfg = config_for(saved["fp32"], "fsdp2")
    assert {k: cfg.model[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")} == \
        {"hidden_size": 32, "num_hidden_layers": 3, "intermediate_size": 48}
    typed = ["model.hidden_size=64"]
    cfg = compose(["model=hf_causal_lm", f"model.pretrained={saved['fp32']}", *typed])
    [problem] = model_problems(cfg, typed)
    assert problem.keys == ("model.pretrained",)
    assert "model.hidden_size=64 contradicts" in problem.message and "hidden_size=32" in problem.message
    # The same value typed is no contradiction.
    typed = ["model.hidden_size=32", "model.architecture=llama"]
    assert model_problems(compose(["model=hf_causal_lm", f"model.pretrained={saved['fp32']}", *typed]), typed) == []


def test_the_plan_counts_the_pretrained_model_and_what_each_rank_reads(saved):
    from hydraddp.plan.__main__ import plan_overrides

    est = plan_overrides(["model=hf_causal_lm", f"model.pretrained={saved['bf16']}", "wrap=fsdp2",
                          "launcher.nproc_per_node=2", "backend=gloo"])
    from safetensors import safe_open

    with safe_open(str(saved["bf16"] / "model.safetensors"), "pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert sum(u.numel for u in est.units) == numel  # config.json's sizes, not the yaml's
    # Rank 0 reads its half of every tensor, in the file's bf16.
    assert est.build == "meta" and est.pretrained_read_bytes == numel // 2 * torch.bfloat16.itemsize


@pytest.mark.parametrize("overrides, says", [
    (["model.pretrained=/nonexistent/weights"], "model.pretrained=/nonexistent/weights: no such file or directory"),
    (["model=gpt", "data=text", "task=causal_lm", "model.pretrained={fp32}"], "only a transformers model loads"),
    (["model.pretrained={empty}"], "neither a Hugging Face model directory"),
])
def test_weights_that_cannot_start_this_model_are_refused_with_the_key(saved, tmp_path, overrides, says):
    (tmp_path / "empty").mkdir()
    overrides = [o.format(fp32=saved["fp32"], empty=tmp_path / "empty") for o in overrides]
    cfg = compose(["model=hf_causal_lm", *overrides])
    [problem] = model_problems(cfg, overrides)
    assert problem.keys == ("model.pretrained",) and says in problem.message


def test_a_hydraddp_checkpoint_of_another_model_is_refused_naming_the_first_keys(pools, tmp_path):
    written = pools.run("tests.train.test_pretrained:gpt_checkpoint", str(tmp_path), 2)
    cfg = compose(["model=gpt", "data=text", "task=causal_lm", "model.depth=3", f"model.pretrained={written[0]}"])
    [problem] = model_problems(cfg, [])
    assert "does not fit this model: missing ['blocks.2." in problem.message, problem.message


def gpt_checkpoint(local_rank: int, root: str, depth: int, wrap: str = "fsdp2") -> str:
    """A hydraddp checkpoint of a small GPT, written by 2 ranks under ``wrap``; its path."""
    import hydraddp.distributed as idist
    from hydraddp.build import build_model
    from hydraddp.train import checkpoint

    cfg = compose(["model=gpt", "data=text", "task=causal_lm", f"model.depth={depth}", f"wrap={wrap}",
                   "trainer.seed=5"])
    model, _ = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    path = checkpoint.save(Path(root), 7, model, optimizer, {"config": OmegaConf.to_container(cfg, resolve=True)})
    idist.barrier()
    return str(path)


def checkpoint_into_other_wraps(local_rank: int, path: str, wraps: list[str]) -> dict:
    """Per wrap: whether the full parameters loaded from the checkpoint equal the saving model's (seed 5)."""
    from hydraddp.build import build_model
    from hydraddp.train import pretrained
    from tests.distributed.workers import full_params

    expected = build_model(compose(["model=gpt", "data=text", "task=causal_lm", "model.depth=2", "wrap=none",
                                    "trainer.seed=5"]))[0].state_dict()
    out = {}
    for wrap in wraps:
        cfg = compose(["model=gpt", "data=text", "task=causal_lm", "model.depth=2", f"wrap={wrap}", "trainer.seed=9",
                       f"model.pretrained={path}"])
        model, _ = build_model(cfg)
        pretrained.load(path, model)
        got = full_params(model)
        out[wrap] = sorted(k for k in expected if not torch.equal(expected[k], got[k].cpu()))
    return out


def test_a_hydraddp_checkpoint_starts_a_run_of_any_wrap_with_its_weights(pools, tmp_path):
    path = pools.run("tests.train.test_pretrained:gpt_checkpoint", str(tmp_path), 2)[0]
    out = pools.run("tests.train.test_pretrained:checkpoint_into_other_wraps", path, ["ddp", "fsdp", "fsdp2"])
    assert out[0] == out[1] == {"ddp": [], "fsdp": [], "fsdp2": []}


@pytest.mark.slow
def test_pretrained_then_trained_then_exported_to_hf_equals_the_checkpoint(saved, tmp_path, mlflow_server):
    """A launch with every default on (plan, tracking, the logged model) from a save_pretrained Llama: the run says
    where its weights came from and what sizes it trained; 10 steps later the HF export loads with from_pretrained and
    equals the DCP checkpoint (read by today's export) tensor for tensor, in several files; so does the directory the
    run's LoggedModel points at (the model is above tracking.model.max_copy_mb)."""
    import transformers
    from mlflow import MlflowClient

    launched = run_cli("model=hf_causal_lm", f"model.pretrained={saved['fp32']}", "wrap=fsdp2", "backend=gloo",
                       "launcher.nproc_per_node=2", "trainer.max_steps=10", "checkpoint.save_last=true", *SMALL_DATA,
                       "tracking.model.max_copy_mb=0.05",  # above it: a LoggedModel that points at an HF export
                       f"tracking.uri={mlflow_server.uri}", "tracking.experiment=pretrained", cwd=tmp_path / "run")
    assert launched.returncode == 0, launched.stderr[-4000:]
    [job] = job_dirs(tmp_path / "run")
    run = MlflowClient(mlflow_server.uri).search_runs(
        [MlflowClient(mlflow_server.uri).get_experiment_by_name("pretrained").experiment_id])[0]
    assert run.data.tags["hydraddp.pretrained"] == str(saved["fp32"].resolve())
    assert run.data.params["model.hidden_size"] == "32" and run.data.params["model.num_hidden_layers"] == "3"
    checkpoint = job / "checkpoints" / "step_00000010"
    out = tmp_path / "hf"
    exported = run_process([sys.executable, "-m", "hydraddp.export", str(checkpoint), str(out), "--format", "hf",
                            "--max-shard-mb", "0.1"], timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    plain = run_process([sys.executable, "-m", "hydraddp.export", str(checkpoint), str(tmp_path / "m.pt")], timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    expected = torch.load(tmp_path / "m.pt", weights_only=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert loaded.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []
    assert loaded["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    # The run's LoggedModel points at the same model in Hugging Face's format, written at the end of the launch.
    [logged] = MlflowClient(mlflow_server.uri).search_logged_models([run.info.experiment_id])
    hf_export = Path(logged.tags["hydraddp.hf_export"])
    assert logged.tags["hydraddp.load"] == f"transformers.AutoModelForCausalLM.from_pretrained('{hf_export}')"
    assert hf_export.parent.parent.parent == job  # <job dir>/model/step_00000010/hf
    in_run = transformers.AutoModelForCausalLM.from_pretrained(hf_export).state_dict()
    assert [k for k in expected if not torch.equal(in_run[k], expected[k])] == []
    # It trained: not the pretrained weights any more.
    start = transformers.AutoModelForCausalLM.from_pretrained(saved["fp32"]).state_dict()
    assert not torch.equal(start["model.embed_tokens.weight"], loaded["model.embed_tokens.weight"])


@pytest.mark.slow
def test_weights_that_do_not_exist_are_exit_2_before_any_worker(tmp_path):
    launched = run_cli("model=hf_causal_lm", "model.pretrained=nowhere/llama", "tracking.enabled=false",
                       cwd=tmp_path)
    assert launched.returncode == 2, launched.stderr[-3000:]
    assert "model.pretrained=nowhere/llama: no such file or directory" in launched.stderr
    assert "Traceback" not in launched.stderr and not list(tmp_path.glob("outputs/*/*/logs/rank*.log"))
