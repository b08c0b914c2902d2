"""Stage 5, attribute: attribution sites computed from an activation and the objective's gradient
where they live (gradient x activation, the CAM family, integrated gradients), and their tables."""
