"""Bundled models. Each may name ``fsdp_block_classes``: the submodules FSDP should shard as units."""
