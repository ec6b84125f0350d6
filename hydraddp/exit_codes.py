"""The contract's exit codes, in one place (README, "Exit codes"): every entry point and the training loop use these."""

EXIT_OK = 0
EXIT_WORKER_FAILED = 1  # a worker failed: the message names the rank and its error
EXIT_INVALID = 2  # invalid configuration, reported before any worker starts, with no traceback
EXIT_PREEMPTED = 3  # stopped by a signal after a complete checkpoint: the same command in the same job dir resumes
EXIT_INTERRUPTED = 130  # Ctrl-C: every worker was stopped
