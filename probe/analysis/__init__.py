"""Analyses over a run's captures: linear and MLP probes (with control tasks), CKA, and
`python -m probe.analyze`."""
