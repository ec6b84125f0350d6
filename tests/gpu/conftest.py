"""Every test under tests/gpu is marked ``gpu`` and skipped, with its reason, on a machine without CUDA."""

from pathlib import Path

import pytest
import torch

GPU_TESTS = Path(__file__).resolve().parent


# tryfirst: the marker must be on the items before `-m gpu` deselects by marker in the same hook.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: torch.cuda.is_available() is False here; run tests/gpu/run.sh on a GPU machine",
    )
    # This hook sees the whole session's items, not only this folder's: pick ours by path.
    for item in items:
        if GPU_TESTS in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            # Prepended, so that without CUDA this reason is the one reported, not a "needs 2 GPUs".
            item.add_marker(no_cuda, append=False)
