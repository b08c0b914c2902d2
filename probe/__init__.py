"""probe: declarative model probing for PyTorch, streamed into chunked HDF5.

The public API, imported on first use so that `import probe` stays light: `run`, `capture`,
`sites`, `open_run`, `open_sweep`, `watch`, `attribution_graph` and the error types. Everything else lives in the stage
subpackages, in the order data flows (docs/architecture.md): models, data, hooks, stats, store,
attribute, intervene, read, analysis, report, launch, train.
"""

__version__ = "0.1.0"

_API = {
    "run": ("probe.launch.api", "run"),
    "capture": ("probe.hooks.memory", "capture"),
    "sites": ("probe.hooks.site_table", "sites"),
    "open_run": ("probe.read.runs", "open_run"),
    "open_sweep": ("probe.read.runs", "open_sweep"),
    "watch": ("probe.train.watched_run", "watch"),
    "attribution_graph": ("probe.graphs.prompt_graph", "attribution_graph"),
    "ProbeError": ("probe.errors", "ProbeError"),
    "ConfigError": ("probe.errors", "ConfigError"),
    "DataError": ("probe.errors", "DataError"),
    "WriteError": ("probe.errors", "WriteError"),
}


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'probe' has no attribute {name!r}")
    import importlib

    module, attr = _API[name]
    return getattr(importlib.import_module(module), attr)


__all__ = list(_API)
