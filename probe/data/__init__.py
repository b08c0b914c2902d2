"""Data: the ordered batches a run visits (images, token ids, text, clean/corrupt pairs, a
caller's own batches), their labels, and the dataset's identity for resume."""
