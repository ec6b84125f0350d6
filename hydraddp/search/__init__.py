"""Hyperparameter search over launches: optuna asks in the sweeper's process, each trial is one launch
(``hydra/sweeper=hydraddp_optuna``; the plugin's registration is ``hydra_plugins/hydraddp_optuna_sweeper``)."""
