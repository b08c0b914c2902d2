"""Store: probe.h5 itself: its format, the writer, the disk-space guard, resume, stitching
shards, the run file's state and the run directory's lock."""
