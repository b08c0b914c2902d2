"""Stage 4, store: probe.h5 itself: its format, the writer, the disk-space guard, resume,
stitching shards, reading a run file and the run directory's lock."""
