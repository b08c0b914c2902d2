"""Attribution: sites computed from an activation and the objective's gradient where they live
(gradient x activation, the CAM family, integrated gradients), the logit and tuned lens, direct
logit attribution, and their tables."""
