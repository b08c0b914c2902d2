"""Interventions: declared edits (ablations, patching, steering, gradient surgery), the passes
they need, patching grids, attribution patching, and the effects on the model's answer."""
