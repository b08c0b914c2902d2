"""Hooks: the one owner of every hook handle (`hookset`), the modules a probe selects, the hooks
that copy what a batch produces, the forward and the objective, device transfers, and in-memory
captures (`probe.capture`)."""
