"""The project's error type. Framework-free leaf.

Every error a user can fix (a bad config value, missing data, an unusable model folder, a failed
solve, an output folder that must not be touched) derives from :class:`ShiftError`. The entry
points print such an error as one line naming the problem and the fix, exit with status 2 and
show no traceback (``--debug`` shows it); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ShiftError(Exception):
    """An error the user can act on (see the module docstring)."""


class ConfigError(ShiftError, ValueError):
    """Inconsistent or impossible configuration (found before any model is loaded where possible)."""


class DataError(ShiftError, ValueError):
    """Missing or malformed data."""


class UsageError(ConfigError):
    """A command line the parser refuses (unknown option, wrong type, empty config file)."""
