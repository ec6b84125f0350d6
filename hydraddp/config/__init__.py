"""The Hydra side of hydraddp: schemas, composing, validation, instantiation."""
