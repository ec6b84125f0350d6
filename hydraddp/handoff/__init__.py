"""What one process hands another, read and written the same way on both sides: checkpoint roots, pretrained
weights, preemption markers, a launch's result, a search trial's spec. Below the loop, the preflight, the search and
the commands, which all use it; it imports nothing above the models."""
