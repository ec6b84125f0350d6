"""Tests of backend=horovod, with Horovod 0.28.1 built by scripts/install_horovod.sh."""

import os

import pytest

from hydraddp.distributed import has_hvd_support

# Every test here launches Horovod for real; CI always builds it, so there it never skips.
HOROVOD_TESTS = [pytest.mark.slow, pytest.mark.skipif(
    not has_hvd_support and not os.environ.get("CI"),
    reason="Horovod is not installed here: bash scripts/install_horovod.sh (CI always builds it, so never skips)",
)]
