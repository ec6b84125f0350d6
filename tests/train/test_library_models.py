"""Models from the field's own libraries, built from config (the ``models`` extra): a Hugging Face causal LM from its
config class, nothing downloaded. It brings its own data (token dicts) and computes its own loss."""

from __future__ import annotations

import json

import pytest

from tests.helpers.spawn import job_dirs, run_cli

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

pytest.importorskip("transformers", reason="the models extra: pip install 'hydraddp[models]'")

HF = ["model=hf_causal_lm", "task=causal_lm"]
DECODER_UNITS = ["<root>", "model.layers.0", "model.layers.1"]  # from LlamaForCausalLM._no_split_modules


def test_a_transformers_causal_lm_trains_under_fsdp2_in_bf16_with_a_unit_per_decoder_layer(tmp_path):
    # pad_token_id: a config key that names a vocabulary entry, not a credential (it was once redacted, and the
    # LoggedModel's rebuild then failed on "***redacted***").
    done = run_cli(*HF, "+model.pad_token_id=0", "wrap=fsdp2", "precision=bf16", "trainer.max_steps=30",
                   "trainer.log_every=10", "trainer.eval_every=0", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                   cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    [job] = job_dirs(tmp_path)
    result = json.loads((job / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["losses"]["30"] < result["losses"]["10"] < 4.0  # ln(128) = 4.85 at random weights
    for report in result["reports"]:
        assert report["wrapper"] == "fsdp2" and report["param_dtype"] == "bfloat16"
        assert report["units"] == DECODER_UNITS
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["hydraddp.model"] == "hydraddp.models.hf.causal_lm"  # the _target_, a factory
    assert run.data.tags["hydraddp.model_class"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert run.data.tags["hydraddp.task"] == "hydraddp.train.tasks.CausalLM"
    assert run.data.metrics["eval/perplexity"] < 60
    assert run.data.params["model.pad_token_id"] == "0"
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    [output] = client.get_run(run.info.run_id).outputs.model_outputs
    loaded = mlflow.pytorch.load_model(f"models:/{output.model_id}")
    assert loaded.config.pad_token_id == 0 and type(loaded).__name__ == "LlamaForCausalLM"


def test_ddp_and_fsdp2_give_the_fp32_losses_of_one_process(pools):
    common = [*HF, "optim=sgd", "optim.optimizer.lr=0.1", "trainer.max_steps=5", "trainer.log_every=1",
              "trainer.eval_every=0", "data.batch_size=8", "trainer.grad_clip=null"]
    [serial] = pools.run("tests.train.workers:train_configs", {"one": [*common, "backend=none", "wrap=none",
                                                                       "launcher.nproc_per_node=1"]},
                         backend="none", nproc=1, timeout=300).values()
    dist = pools.run("tests.train.workers:train_configs",
                     {wrap: [*common, f"wrap={wrap}"] for wrap in ("ddp", "fsdp2")}, timeout=300)
    one = serial["one"]["losses"]
    assert len(one) == 5 and one[5] < one[1]
    for wrap in ("ddp", "fsdp2"):
        for step, loss in one.items():
            assert abs(dist[0][wrap]["losses"][step] - loss) < 1e-5, (wrap, step, dist[0][wrap]["losses"], one)
    assert dist[0]["fsdp2"]["units"] == DECODER_UNITS and dist[0]["ddp"]["units"] == ["<root>"]
