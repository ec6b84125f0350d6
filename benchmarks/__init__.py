"""Side-by-side measurements of hydraddp against a plain torchrun script and PyTorch-Ignite (not tests)."""
