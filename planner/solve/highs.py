"""HiGHS where it is installed (``bash setup.sh`` installs highspy; PuLP's CBC is the
fallback): whether it is, and an instance that does not print its banner."""
from __future__ import annotations

import os
import sys


def available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def quiet():
    """A ``highspy.Highs()``, without the banner it prints on stdout before any option can
    silence it."""
    import highspy
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
