"""This process's one computation model: what ``utils``' functions read, and what every worker ``elastic`` starts sets.

It names no model class: its callers hand it one (``utils.initialize`` picks it from the backend, a model's ``spawn``
passes its own). That keeps it below the models that spawn workers and below ``utils``, which knows them all, so
``comp_models`` -> ``elastic`` -> here never loops back.
"""

from __future__ import annotations

from typing import Any

from hydraddp.parallel import machine
from hydraddp.distributed.comp_models.base import ComputationModel, _SerialModel

_context: ComputationModel = _SerialModel()
# False once a model was set for good (initialize, spawn): then nothing is looked up again.
_look_for_context = True


def set_model(model: ComputationModel, temporary: bool = False) -> None:
    """Make ``model`` the current one. A serial or ``temporary`` model leaves the lookup on."""
    global _context, _look_for_context
    _context = model
    _look_for_context = temporary or isinstance(model, _SerialModel)


def model() -> ComputationModel:
    """The model set last, as it is (``utils.current`` also adopts a context someone else started)."""
    return _context


def looking_for_context() -> bool:
    """Whether nobody pinned a model yet: ``utils.current`` then adopts whatever process group exists now."""
    return _look_for_context and isinstance(_context, _SerialModel)


def raise_if_active() -> None:
    if not isinstance(_context, _SerialModel):
        raise RuntimeError(f"A distributed context is already active ({_context!r}); call finalize() first")


def start(model_cls: type[ComputationModel], backend: str, **kwargs: Any) -> None:
    """Check that this machine can run ``backend``, then start ``model_cls`` on it as this process's model."""
    machine.raise_for_problems(machine.combination(backend=backend), ["backend"])
    set_model(model_cls.create_from_backend(backend, **kwargs))


def finalize() -> None:
    """Tear down the context (``dist.destroy_process_group()`` for the native backends); then the serial model
    answers again."""
    _context.finalize()
    set_model(_SerialModel())
