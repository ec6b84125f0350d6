"""What of a config is a secret: keys by their words, values from the environment, lists walked, URI passwords."""

import pytest

from hydraddp.redaction import REDACTED, is_secret_key, redact, redact_overrides, secret_paths

# Real keys that must reach MLflow, config.yaml and checkpoints as they are: Hugging Face configs and tokenizers,
# torch's arguments, Hydra's own keys, and hydraddp's.
KEPT = ["model.pad_token_id", "model.bos_token_id", "model.eos_token_id", "decoder_start_token_id", "token_type_ids",
        "max_tokens", "max_new_tokens", "add_special_tokens", "tokenizer.name", "tokenizer_class", "pad_token",
        "sep_token", "mask_token", "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings",
        "key_padding_mask", "keypoints", "trainer.num_passes", "bypass", "compass_heading", "author", "authors",
        "pin_memory", "persistent_workers", "find_unused_parameters", "gradient_as_bucket_view",
        "hydra.job.chdir", "hydra.job.config.override_dirname.kv_sep", "hydra.sweep.subdir", "tracking.uri",
        "tracking.run_name", "checkpoint.keep_last", "launcher.rdzv_endpoint"]
# Keys whose values must never leave the launch: the shapes secrets take in configs and environments.
SECRET = ["api_key", "apiKey", "API_KEY", "hfApiKey", "hf_token", "HF_TOKEN", "hub_token", "use_auth_token", "token",
          "access_token", "auth_token", "bearer_token", "password", "db.passwd", "db.pass", "smtp_pwd", "passphrase",
          "client_secret", "trainer.secrets.db", "aws_secret_access_key", "aws_access_key_id", "private_key",
          "privateKey", "ssh_key", "credentials", "gcp.credential", "Authorization", "auth",
          "MLFLOW_TRACKING_PASSWORD", "mlflow_tracking_token"]


@pytest.mark.parametrize("key", KEPT)
def test_a_key_that_only_contains_a_secret_word_is_kept(key):
    assert not is_secret_key(key)


@pytest.mark.parametrize("key", SECRET)
def test_a_key_that_names_a_secret_is_redacted(key):
    assert is_secret_key(key)
    assert redact({"x": {key: "v"}}) == {"x": {key: REDACTED}}


def test_secrets_from_env_by_key_in_lists_and_in_uris_are_redacted_everywhere():
    unresolved = {"tracking": {"tags": {"team": "${oc.env:TEAM_SECRET}", "owner": "me"}},
                  "data": {"dataset": {"api_key": "plain", "path": "/x"}},
                  "trainer": {"hooks": [{"name": "notify", "api_key": "X"}, "${oc.env:HOOK}"]},
                  "model": {"pad_token_id": 0}}
    resolved = {"tracking": {"tags": {"team": "s3cr3t", "owner": "me"}, "uri": "postgresql://user:PW@db:5432/mlflow"},
                "data": {"dataset": {"api_key": "plain", "path": "/x"}},
                "trainer": {"hooks": [{"name": "notify", "api_key": "X"}, "hook-secret"]},
                "model": {"pad_token_id": 0}}
    secrets = secret_paths(unresolved)
    assert secrets == {"tracking.tags.team", "data.dataset.api_key", "trainer.hooks.0.api_key", "trainer.hooks.1"}
    redacted = redact(resolved, secrets)
    assert redacted["tracking"] == {"tags": {"team": REDACTED, "owner": "me"}, "uri": "postgresql://user:***@db:5432/mlflow"}
    assert redacted["data"]["dataset"] == {"api_key": REDACTED, "path": "/x"}
    assert redacted["trainer"]["hooks"] == [{"name": "notify", "api_key": REDACTED}, REDACTED]
    assert redacted["model"] == {"pad_token_id": 0}
    assert resolved["tracking"]["tags"]["team"] == "s3cr3t" and resolved["trainer"]["hooks"][0]["api_key"] == "X"


def test_overrides_are_redacted_by_key_by_what_they_hold_and_by_uri():
    assert redact_overrides(["+data.dataset.api_key=plain", "wrap=ddp", "+model.pad_token_id=0",
                             "+trainer.hooks=[{name: notify, api_key: X}]",
                             "tracking.uri=https://me:pw@mlflow.example.com", "+db={host: h, password: x}"],
                            {"data.dataset.api_key"}) == \
        [f"+data.dataset.api_key={REDACTED}", "wrap=ddp", "+model.pad_token_id=0", f"+trainer.hooks={REDACTED}",
         "tracking.uri=https://me:***@mlflow.example.com", f"+db={REDACTED}"]
