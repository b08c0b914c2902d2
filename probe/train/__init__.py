"""Probing the user's own training: `probe.watch` (per-step statistics, the probe batch,
gradient edits), on any loop that runs its own forward, backward and optimizer step."""
