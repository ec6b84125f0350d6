"""The training loop that every rank runs."""

from hydraddp.train.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
