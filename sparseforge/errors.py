"""The one exception type the CLI turns into a one-line message (no traceback), and the option check every verb uses."""


class SparseforgeError(Exception):
    """A user-facing error: says what was wrong, with the offending value, and what to do."""


def check_positive(**values) -> None:
    """Each given option (None = unset) must be > 0; the error names it as its flag."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise SparseforgeError(f"--{name.replace('_', '-')} must be positive, got {value}")
