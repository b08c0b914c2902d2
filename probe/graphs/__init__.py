"""Attribution graphs: feature circuits through transcoders (docs/graphs.md)."""
