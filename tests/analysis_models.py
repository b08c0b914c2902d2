"""Small models for the statistics tests, built by `model=custom model._target_=...`."""

from __future__ import annotations

import os

import torch
from torch import nn

DEAD = 2  # the channel forced negative before the ReLU
SATURATED = 1  # the channel pushed far into tanh's bound


class DeadChannel(nn.Module):
    """conv -> (channel DEAD set to -1 - |x|) -> ReLU, and a tanh branch with channel SATURATED * 50."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.tanh = nn.Tanh()
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        h = self.conv(x)
        mask = torch.zeros(1, h.shape[1], 1, 1, dtype=torch.bool)
        mask[:, DEAD] = True
        h = torch.where(mask, -1.0 - h.abs(), h)
        scale = torch.ones(1, h.shape[1], 1, 1)
        scale[:, SATURATED] = 50.0
        t = self.tanh(torch.sign(h) * (h.abs() + 1.0) * scale)
        r = self.relu(h)
        return self.head((r + t).mean(dim=(2, 3)))


class DiesOnThirdBatch(nn.Module):
    """A tiny conv net whose process is killed (os._exit) at its third forward: a run cut short."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, num_classes)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            import time

            time.sleep(1.0)  # let the writer thread flush the first two batches
            os._exit(9)
        return self.head(self.conv(x).mean(dim=(2, 3)))
