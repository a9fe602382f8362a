"""The user-error family: a mistake in what the user asked for (a config key, a file, a folder), not a bug.

The command line prints a `UserError` as one line, `error: <message>`, and exits 2 before any work is
done (`--debug` shows its traceback). A message says what is wrong, where, and which key or file.
Modules that find such mistakes raise a subclass (`config.ConfigError`, `data.datasets.DatasetError`, …).

A `RunError` is a fault met while the run works (the environment fails every rollout): also one line
`error: <message>`, with its own exit status (`RunError.exit_status`), after the run has kept what it
trained (checkpoints saved, metrics flushed).
"""


class UserError(Exception):
    """A mistake in the user's input: reported as one line and exit 2, never as a traceback."""


class RunError(Exception):
    """A fault that stops a run partway, not a mistake in the input: one line and exit status 3."""

    exit_status = 3
