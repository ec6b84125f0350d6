"""What a finished launch leaves in its job directory for whoever started it: rank 0's result (a search's sweeper
reads a trial's, ``search.launch``) and how it ended (a sweep's summary reads each job's, ``sweep``). ``cli`` writes
both."""

RESULT_FILE = "result.json"  # rank 0's TrainResult, with the MLflow run's id
OUTCOME_FILE = "outcome.json"  # in a sweep job's directory: what the job's launch ended with, for the summary
