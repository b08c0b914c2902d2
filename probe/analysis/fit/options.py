"""What a transcoder fit trains: its options, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from probe.errors import ConfigError
from probe.models.transcoder import ACTIVATIONS, READS

FIT_READS = ("mlp_in", "resid_mid")  # mlp_normalized is not captured by a run


@dataclass(frozen=True)
class FitOptions:
    """What a fit trains (see the module docstring). `width` None: 8 x the input's width;
    `sparsity` None: 1e-2 (relu and jumprelu); `steps` per layer (None: `epochs`)."""

    activation: str = "relu"
    width: int | None = None
    k: int = 16
    reads: str = "mlp_in"
    skip: bool = False
    steps: int | None = None
    epochs: float = 1.0
    lr: float = 1e-3
    sparsity: float | None = None
    batch_size: int = 1024
    test_fraction: float = 0.1
    seed: int = 0
    threshold: float = 0.1  # jumprelu's initial threshold (on the scaled pre-activations)
    bandwidth: float = 0.05  # jumprelu's straight-through kernel width
    checkpoint_every: int = 200
    buffer_rows: int | None = None
    keep_special: bool = False  # train and measure on position-0 and special-token rows too

    def check(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"--activation {self.activation!r}; choose {', '.join(ACTIVATIONS)}")
        if self.reads == "mlp_normalized":
            raise ConfigError(
                "--reads mlp_normalized: a fit reads captured token rows, and a run captures no "
                "norm output without its weight and bias; fit --reads mlp_in or resid_mid"
            )
        if self.reads not in READS:
            raise ConfigError(f"--reads {self.reads!r}; choose {', '.join(FIT_READS)}")
        positive = {"--batch-size": self.batch_size, "--lr": self.lr, "--epochs": self.epochs,
                    "--checkpoint-every": self.checkpoint_every, "--k": self.k,
                    "--bandwidth": self.bandwidth, "--threshold": self.threshold}  # fmt: skip
        if self.width is not None:
            positive["--width"] = self.width
        if self.steps is not None:
            positive["--steps"] = self.steps
        bad = [f"{k} {v}" for k, v in positive.items() if not v > 0]
        if self.sparsity is not None and self.sparsity < 0:
            bad.append(f"--sparsity {self.sparsity}")
        if not 0 < self.test_fraction < 1:
            bad.append(f"--test-fraction {self.test_fraction} (want it in (0, 1))")
        if bad:
            raise ConfigError(f"{', '.join(bad)}: each must be above 0")

    @property
    def penalty(self) -> float:
        if self.sparsity is not None:
            return self.sparsity
        return {"relu": 1e-2, "jumprelu": 1e-2, "topk": 0.0}[self.activation]
