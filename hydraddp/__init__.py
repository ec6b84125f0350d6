"""hydraddp: distributed-training experiments from composed Hydra config.

``import hydraddp`` stays light: ``build_model`` (and with it torch, Hydra) loads on first use, and MLflow
only when a run logs.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "build_model":
        from hydraddp.build import build_model

        return build_model
    raise AttributeError(f"module 'hydraddp' has no attribute {name!r}")
