"""Stage 6, intervene: declared edits (ablations, patching, steering, gradient surgery), the
passes they need and the effects they have on the model's answer."""
