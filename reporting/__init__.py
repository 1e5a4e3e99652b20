"""Reports of a reproduction (`reporting.report`), loaded only by train.py's summarize and report
commands."""
