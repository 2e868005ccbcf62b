"""User-facing errors: one clear line naming the problem and the fix, exit code 2 on the CLI."""
from __future__ import annotations

import functools
import sys


class UserError(ValueError):
    """Bad input the user can fix (a wrong path, a malformed file, a mesh that does not fit)."""


def cli(main):
    """Wrap a command-line `main`: a UserError becomes one line on stderr and exit code 2."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    return wrapper
