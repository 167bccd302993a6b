"""The one exception the library raises for bad input; the CLI prints it as one line and exits 2."""


class UserError(Exception):
    """Bad input from the user (a flag, a file, a run folder): printed as one line, exit code 2."""
