"""Know before you launch: ``python -m hydraddp.plan [overrides]`` runs the config's own wrap and training step in a
simulated world and prints the wrap plan and one rank's memory, for every wrap, and what fits ``plan.budget_gb``."""
