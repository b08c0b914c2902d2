"""probe: declarative model probing for PyTorch, streamed into chunked HDF5."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`probe.run(model, data, probes, out=...)`, `probe.sites`, `probe.capture`,
    `probe.open_run`, `probe.open_sweep` and the error types, imported on first use (keeps `import probe` light)."""
    if name in ("open_run", "open_sweep"):
        from probe import reading

        return getattr(reading, name)
    if name in ("sites", "run"):  # modules callable as their main function (probe.callable)
        import importlib

        return importlib.import_module(f"probe.{name}")
    if name == "capture":
        from probe import memory

        return memory.capture
    if name in ERRORS:
        from probe import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'probe' has no attribute {name!r}")


ERRORS = ("ProbeError", "ConfigError", "DataError", "WriteError")
__all__ = ["run", "sites", "capture", "open_run", "open_sweep", *ERRORS]
