"""The sweeper class Hydra instantiates: Hydra takes plugins from the ``hydra_plugins`` package only."""

from hydraddp.search.sweeper import OptunaSearch


class HydraddpOptunaSweeper(OptunaSearch):
    """``hydra/sweeper=hydraddp_optuna`` (``hydraddp.search.sweeper.OptunaSearch``)."""
