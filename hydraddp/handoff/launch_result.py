"""What a finished launch leaves for whoever started it (a search's sweeper, a script): rank 0's result in the job
directory. ``cli`` writes it; ``search.launch`` reads a trial's."""

RESULT_FILE = "result.json"  # in the job directory: rank 0's TrainResult, with the MLflow run's id
