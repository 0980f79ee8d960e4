"""One exception type for mistakes a user can fix: the CLI prints it on one line and exits 2."""


class UserError(Exception):
    """Bad input (a path, a file, a flag): reported as one line, never as a traceback."""
