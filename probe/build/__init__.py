"""Stage 1, build: the model, the ordered batches, and the modules and sites a probe selects."""
