"""Bundled data sets; nothing is downloaded. Each builder returns ``(train, eval)`` datasets."""
