"""Models: building a network (torchvision, timm, HuggingFace, custom), loading checkpoints and
SAEs, placing weights on devices, and its anatomy (which module is a block, an attention output,
an MLP, the final norm, the unembedding)."""
