"""Reading a run: `probe.open_run` / `open_sweep`, arrays and slabs of probe.h5 in bounded memory,
summary tables, top-k examples, SAE latents, and captures as a shuffled training stream."""
