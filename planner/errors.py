"""Errors a user can cause, each with the exit code the CLI documents.

The CLI prints ``str(err)`` as one line and exits with ``err.exit_code``; nothing else
reaches the user. Messages name the input and the fix.
"""


class UserError(Exception):
    """Bad input: unreadable file, wrong schema, unknown model, malformed size (exit 2)."""

    exit_code = 2


class NoFitError(UserError):
    """No plan fits the budgets (exit 3). Names the short budget and the smallest that fits."""

    exit_code = 3

    def __init__(self, message: str, budget: str = "", needed_bytes: int | None = None):
        super().__init__(message)
        self.budget = budget
        self.needed_bytes = needed_bytes


# The signals ``plan`` caught in this command, as the exceptions its handlers raised
# (``planner.cli``): a C extension can swallow one (Ctrl-C during ``import torch``), so the
# command's end and ``write_atomic`` look here too. Cleared as each ``plan`` command starts and
# ends; only the CLI's handlers fill it.
CAUGHT_SIGNALS: list = []
