"""hydraddp's optuna sweeper, where Hydra finds plugins: ``hydra/sweeper=hydraddp_optuna`` (the sweeper itself is
``hydraddp.search.sweeper``)."""
