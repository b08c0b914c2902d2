"""Stage 7, analysis: tables, the reading API, plots, reports, linear probes and CKA over run files."""
