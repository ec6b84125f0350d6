"""How a model is spread over ranks (torch only; nothing of Hydra, MLflow or ``hydraddp.distributed``'s contexts):
the one pipeline every wrap goes through (``parallelize``, driven by ``plan.Layout``), its steps (``tp``,
``policies``, ``wrappers``, ``precision``), the device mesh (``mesh``), the meta-device build and its materializing
(``meta_init``, ``meta_record``, ``meta_steps``), the rules of which combinations run where (``combinations``,
``machine``), and the stand-ins a plan uses under fake tensors (``simulation``)."""
