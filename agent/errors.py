"""The one exception the library raises for bad input, and the line an OSError becomes; the CLI
prints either as one line and exits 2."""

import errno


class UserError(Exception):
    """Bad input from the user (a flag, a file, a run folder): printed as one line, exit code 2."""


def os_error_line(e: OSError) -> str:
    """The file and what the system said. A full disk's write often fails as its file closes,
    where the error names no file: it says what to do instead."""
    if e.errno == errno.ENOSPC:
        where = f"{e.filename}: no space left on its disk" if e.filename else \
            "no space left on a disk this command writes to"
        return f"{where}; free some space and run this again"
    return f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}"
