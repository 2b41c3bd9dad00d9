"""The one exception type the CLI turns into a one-line message (no traceback)."""


class SparseforgeError(Exception):
    """A user-facing error: says what was wrong, with the offending value, and what to do."""
