"""What a transcoder fit trains: its options, checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from probe.errors import ConfigError
from probe.models.transcoder import READS

FIT_READS = ("mlp_in", "resid_mid")  # mlp_normalized is not captured by a run
# the activations a fit trains; batchtopk is saved as a jumprelu with its learnt threshold
FIT_ACTIVATIONS = ("relu", "jumprelu", "topk", "batchtopk")
# the default penalty coefficient of each activation (see transcoder_trainer.py for what each scales)
PENALTY = {"relu": 0.03, "jumprelu": 1.0, "topk": 0.0, "batchtopk": 0.0}
# the default learning rate: LR at LR_WIDTH features, times sqrt(LR_WIDTH / width) (sparsify's
# 1/sqrt(width) rule). On docs/bench/fit_planted.md's problem at width 256, 30 epochs, block 0:
# relu FVU 0.572 / 34% of the planted directions found at 1e-3 (10 epochs), 0.017 / 98% at 1e-2
# and 2e-2; topk 0.067 / 96% at 1e-2, 0.042 / 96% at 2e-2; batchtopk 0.065 / 95% at 1e-2,
# 0.018 / 98% at 2e-2.
LR, LR_WIDTH = 2e-2, 256


@dataclass(frozen=True)
class FitOptions:
    """What a fit trains (probe.analysis.fit.transcoder_trainer says what each does). `width` None: 8 x the
    input's width; `lr` None: LR x sqrt(LR_WIDTH / width); `sparsity` None: PENALTY[activation];
    `l0_target` None: `k`; `aux_k` None: half the output's width; `steps` per layer (None:
    `epochs`)."""

    activation: str = "relu"
    width: int | None = None
    k: int = 16
    l0_target: float | None = None
    reads: str = "mlp_in"
    skip: bool = False
    steps: int | None = None
    epochs: float = 1.0
    lr: float | None = None
    lr_warmup: float = 0.02  # share of the steps the learning rate rises over, from 0
    lr_decay: float = 0.2  # share of the steps (the last ones) it falls over, to 0
    sparsity: float | None = None
    sparsity_warmup: float = 0.05  # share of the steps the penalty rises over, from 0
    aux_k: int | None = None
    aux_coefficient: float = 1 / 32
    dead_rows: int = 50_000  # rows a feature has not fired on for AuxK to count it dead
    batch_size: int = 1024
    test_fraction: float = 0.1
    seed: int = 0
    threshold: float = 0.001  # jumprelu's initial threshold (on the scaled pre-activations)
    bandwidth: float = 0.01  # jumprelu's straight-through kernel width
    checkpoint_every: int = 200
    buffer_rows: int | None = None
    keep_special: bool = False  # train and measure on position-0 and special-token rows too

    def check(self) -> None:
        if self.activation not in FIT_ACTIVATIONS:
            raise ConfigError(
                f"--activation {self.activation!r}; choose {', '.join(FIT_ACTIVATIONS)}"
            )
        if self.reads == "mlp_normalized":
            raise ConfigError(
                "--reads mlp_normalized: a fit reads captured token rows, and a run captures no "
                "norm output without its weight and bias; fit --reads mlp_in or resid_mid"
            )
        if self.reads not in READS:
            raise ConfigError(f"--reads {self.reads!r}; choose {', '.join(FIT_READS)}")
        positive = {"--batch-size": self.batch_size, "--epochs": self.epochs,
                    "--checkpoint-every": self.checkpoint_every, "--k": self.k,
                    "--bandwidth": self.bandwidth, "--threshold": self.threshold,
                    "--dead-rows": self.dead_rows}  # fmt: skip
        for flag, value in (("--width", self.width), ("--steps", self.steps), ("--lr", self.lr),
                            ("--l0-target", self.l0_target), ("--aux-k", self.aux_k)):  # fmt: skip
            if value is not None:
                positive[flag] = value
        bad = [f"{k} {v}" for k, v in positive.items() if not v > 0]
        if self.sparsity is not None and self.sparsity < 0:
            bad.append(f"--sparsity {self.sparsity}")
        if self.aux_coefficient < 0:
            bad.append(f"--aux-coefficient {self.aux_coefficient}")
        if not 0 < self.test_fraction < 1:
            bad.append(f"--test-fraction {self.test_fraction} (want it in (0, 1))")
        for flag, share in (("--lr-warmup", self.lr_warmup), ("--lr-decay", self.lr_decay),
                            ("--sparsity-warmup", self.sparsity_warmup)):  # fmt: skip
            if not 0 <= share <= 1:
                bad.append(f"{flag} {share} (a share of the steps: want it in [0, 1])")
        if self.lr_warmup + self.lr_decay > 1:
            bad.append(f"--lr-warmup {self.lr_warmup} + --lr-decay {self.lr_decay} (above 1)")
        if bad:
            raise ConfigError(f"{', '.join(bad)}: each must be above 0 unless said otherwise")
        if self.width is not None:
            self.feature_width(1)  # k against a given width, before any row is read

    def feature_width(self, d_in: int) -> int:
        """Features a layer for inputs of width `d_in`: `width`, else 8 x d_in. ConfigError
        where topk or batchtopk would choose more than that (`k` above it), or where jumprelu's
        L0 target (`l0_target`, else `k`) asks for more active features than there are."""
        width = self.width or 8 * d_in
        if self.activation in ("topk", "batchtopk") and self.k > width:
            flag, value, least = "--k", f"{self.k}", self.k
        elif self.activation == "jumprelu" and self.target_l0 > width:
            flag = "--l0-target" if self.l0_target is not None else "--k"
            default = flag == "--k" and self.k == FitOptions.k  # (the user may not have given it)
            value = f"{self.target_l0:g} (jumprelu's L0 target{', the default' if default else ''})"
            least = math.ceil(self.target_l0)
        else:
            return width
        if self.width:
            raise ConfigError(f"{flag} {value} is above --width {width}: give {flag} <= {width}")
        raise ConfigError(
            f"{flag} {value} is above the default width {width} (8 x the input's {d_in}): give "
            f"{flag} <= {width}, or a --width of {least} or more"
        )

    @property
    def penalty(self) -> float:
        return self.sparsity if self.sparsity is not None else PENALTY[self.activation]

    def learning_rate(self, width: int) -> float:
        """Adam's learning rate for `width` features: `lr`, else LR x sqrt(LR_WIDTH / width)."""
        return self.lr if self.lr is not None else LR * (LR_WIDTH / width) ** 0.5

    @property
    def target_l0(self) -> float:
        """jumprelu's L0 target: `l0_target`, else `k`."""
        return float(self.l0_target if self.l0_target is not None else self.k)

    @property
    def decoder_from_zero(self) -> bool:
        """topk, batchtopk and jumprelu start from W_dec = 0 and a uniform W_enc (nn.Linear's
        init, as sparsify's transcoders) with free decoder rows: on the planted problem at 10
        passes topk's held-out FVU was 0.05 against 0.08 from the tied init with free rows and
        0.34 with unit rows (docs/bench/transcoders.md); jumprelu's 0.034 against 0.25 from unit
        rows tied to the encoder (docs/bench/fit_planted.md)."""
        return self.activation in ("topk", "batchtopk", "jumprelu")
