"""Bundled models, and the model of a config (``of_config.model_of``: the one way hydraddp builds it). Each bundled
model may name ``fsdp_block_classes``: the submodules FSDP should shard as units."""

# hydraddp's own keys inside any model node; they steer the build and wrapping, and are not constructor arguments.
HYDRADDP_MODEL_KEYS = ("sync_bn", "init_device", "pretrained")
