"""WrapReport's module names: the wrappers' own levels are dropped as whole name parts, nothing else."""

import pytest

from hydraddp.distributed.report import ROOT, _clean


@pytest.mark.parametrize("name, under_wrapper, clean", [
    ("a.submodule.b", False, "a.submodule.b"),  # str.replace("module.") made this "a.subb"
    ("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module", False, "blocks.0"),
    ("blocks.1._checkpoint_wrapped_module.mlp", False, "blocks.1.mlp"),
    ("module.encoder.module_list.0", True, "encoder.module_list.0"),
    ("module", True, ROOT),
    ("module.x", False, "module.x"),  # a user's own child called "module", with no DDP around it
    ("", False, ROOT),
])
def test_names_are_cleaned_part_by_part(name, under_wrapper, clean):
    assert _clean(name, under_wrapper) == clean
