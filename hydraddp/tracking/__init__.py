"""MLflow tracking: the only package that imports mlflow, and only in the modules that need it.

Workers never talk to MLflow. The rank that holds the run's writer appends events (metrics, tags) to
``<job dir>/events.jsonl``; a tracker process of the launch's (``process.py``) tails that file into MLflow.
A slow or absent server never blocks a training step, and the file keeps every point until it is sent.
"""
