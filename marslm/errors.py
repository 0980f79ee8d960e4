"""One exception type for mistakes a user can fix: the CLI prints it on one line and exits 2."""

EXIT_USAGE = 2  # a mistake the user can fix: one line on stderr


class UserError(Exception):
    """Bad input (a path, a file, a flag): reported as one line, never as a traceback."""
