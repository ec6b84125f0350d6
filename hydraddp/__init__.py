"""hydraddp: distributed-training experiments from composed Hydra config.

``import hydraddp`` stays light (torch only): MLflow and Hydra load when a run needs them.
"""

__version__ = "0.1.0"
