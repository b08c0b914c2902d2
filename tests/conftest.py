"""Shared fixtures."""

import pytest


@pytest.fixture
def small_resnet():
    """Overrides for a quick resnet18 run: 7 samples of 64x64 in batches of 3 (the last one short)."""
    return [
        "model=resnet18",
        "dataset.image_size=64",
        "dataset.num_samples=7",
        "dataset.batch_size=3",
    ]
