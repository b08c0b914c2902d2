"""probe: declarative model probing for PyTorch, streamed into chunked HDF5."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`probe.open_run` / `probe.open_sweep`, imported on first use (keeps `import probe` light)."""
    if name in ("open_run", "open_sweep"):
        from probe import reading

        return getattr(reading, name)
    raise AttributeError(f"module 'probe' has no attribute {name!r}")


__all__ = ["open_run", "open_sweep"]
