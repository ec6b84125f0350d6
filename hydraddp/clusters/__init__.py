"""Clusters hydraddp runs on through their own engines: Slurm through submitit (``submitit``), Kubernetes through the
Kubeflow training operator's PyTorchJob (``kube``). Nothing here schedules, queues or supervises: those engines do."""
