"""probe: declarative model probing for PyTorch, streamed into chunked HDF5."""

__version__ = "0.1.0"
