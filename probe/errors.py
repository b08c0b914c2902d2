"""User-facing errors: each names the bad value and the way out.

They subclass the matching built-in too, so callers can catch either.
"""


class ProbeError(Exception):
    """A problem the user can fix; the CLI prints its message without a traceback."""


class ConfigError(ProbeError, ValueError):
    """A config value that is wrong (bad name, out of range, inconsistent)."""


class SelectionError(ConfigError, LookupError):
    """A probe pattern that matches no module."""


class DataError(ProbeError, OSError):
    """A dataset that is missing, empty or of the wrong structure."""


class CheckpointError(ProbeError, OSError):
    """A checkpoint that cannot be read or does not fit the model."""


class WriteError(ProbeError, OSError):
    """The output file could not be written (unwritable directory, disk full).

    `hdf5_unclosed`: HDF5 still holds the file open (a failed flush it retries, and crashes on,
    at exit: probe.__main__ ends the process without that exit)."""

    hdf5_unclosed: bool = False


class ModelError(ProbeError, RuntimeError):
    """The model itself raised or produced values the run was told to refuse."""
