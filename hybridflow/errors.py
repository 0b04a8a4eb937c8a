"""The one exception type for mistakes in what the user gave us: config, data files, reward code, model
directories, checkpoints to resume from.

A `UserError` is the user's to fix, so the CLI prints it as one line and exits 2 (hybridflow/trainers/cli.py);
anything else is a bug and keeps its traceback. Subclasses may also derive from a builtin type
(`DatasetError(UserError, ValueError)`) so callers that catch the builtin keep working. Kept free of imports:
every layer, including the torch-free reward workers, raises it.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's config, files or code; its message says what and where, in one line."""


class RunStopped(UserError):
    """A run stopped by a safety check (too many failing rewards, too many skipped optimizer steps): the
    message names the step and the cause, so a run never ends with exit 0 after its metrics vanished."""
