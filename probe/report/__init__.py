"""Figures and report.html: summary, attribution and lens plots, feature cards, and the page that
gathers them (`python -m probe.plot`, `python -m probe.report`)."""
