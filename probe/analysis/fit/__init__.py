"""Transcoders trained from a run's captures (`python -m probe.fit`): what a fit trains
(options), where it reads (sites), the trainer, the measures fit.csv reports, and the fit itself
(fitting: per-layer training, checkpoints, the written set)."""
