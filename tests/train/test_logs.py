"""Per-rank console logging next to the progress bar."""

from __future__ import annotations


def test_log_lines_are_written_around_a_live_progress_bar(monkeypatch):
    """In a terminal, a log line printed while the bar is drawn goes through tqdm.write, never onto the bar's line."""
    import io
    import logging

    import tqdm

    from hydraddp.train.logs import ConsoleHandler

    written, stream = [], io.StringIO()
    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(lambda cls, text, file=None: written.append(text)))
    handler = ConsoleHandler(stream)
    record = logging.LogRecord("hydraddp", logging.INFO, __file__, 1, "step %d", (5,), None)
    handler.emit(record)
    monkeypatch.setattr(ConsoleHandler, "bar_active", True)
    handler.emit(record)
    assert stream.getvalue() == "step 5\n" and written == ["step 5"]
