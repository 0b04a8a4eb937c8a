"""The user-facing exception types: mistakes in what the user gave us (config, data files, reward code,
model directories, checkpoints to resume from) and runs stopped by a safety check.

A `UserError` is the user's to fix, so the CLI prints it as one line and exits 2 (hybridflow/trainers/cli.py);
anything else is a bug and keeps its traceback. Subclasses also derive from a builtin type
(`DatasetError(UserError, ValueError)`) so callers that catch the builtin keep working. Kept free of imports:
every layer, including the torch-free reward workers, raises them (docs/design.md §7, the layering).
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's config, files or code; its message says what and where, in one line."""


class RunStopped(UserError):
    """A run stopped by a safety check (too many failing rewards, too many skipped optimizer steps): the
    message names the step and the cause, so a run never ends with exit 0 after its metrics vanished."""


class ConfigError(UserError, ValueError):
    """One or more configuration problems; `errors` lists them, each naming its key."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        head = "invalid config" if len(errors) == 1 else f"invalid config ({len(errors)} problems)"
        super().__init__(head + ":\n  - " + "\n  - ".join(self.errors))


class DatasetError(UserError, ValueError):
    """A dataset problem, naming the file and row."""


class ModelNotFound(UserError, ValueError):
    """A model name that is neither a local directory nor in the local Hugging Face cache."""


class ModelFileError(UserError, ValueError):
    """A file of a model or tokenizer directory that cannot be read."""


class RewardSpecError(UserError, ValueError):
    """reward.fn (or a cost_fn) names no usable function: a bad spec, a missing file, an import that fails."""


class RewardFunctionError(RunStopped, RuntimeError):
    """A sample's reward failed under reward.on_error=raise; `errors` lists every failed sample
    (rewards/executor.py's RewardError records)."""

    def __init__(self, message: str, errors: list):
        self.errors = errors
        super().__init__(message)


class RewardFailureError(RunStopped):
    """More than reward.max_error_fraction of a batch's rewards failed; `errors` lists every failed sample."""

    def __init__(self, message: str, errors: list):
        self.errors = errors
        super().__init__(message)
