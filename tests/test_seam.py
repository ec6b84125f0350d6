"""Dependencies point one way: the core loads no Hydra/OmegaConf/MLflow; `import hydraddp` loads no MLflow."""

import subprocess
import sys

import pytest

FORBIDDEN = ("hydra", "omegaconf", "mlflow")


@pytest.mark.parametrize("module, forbidden", [("hydraddp.distributed", FORBIDDEN), ("hydraddp", ("mlflow",))])
def test_import_loads_nothing_forbidden(module, forbidden):
    code = (f"import sys, {module}; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({forbidden!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
