"""Stage 2, hooks: the hooks that copy what a batch produces, the forward and the objective
that runs it, device transfers, and in-memory captures (`probe.capture`)."""
