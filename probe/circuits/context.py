"""What every method needs of one batch, computed once however many methods run on it: the clean
run's sender states, its logits at the metric's position and its metric, and the ablation's
values (the corrupt run's sender states, the means, or zeros).

The first clean run of a model also checks the identity every edge rests on: the residual stream
at the final norm is the sum of the input's, every attention output projection's and every MLP's
writes. A model that normalises inside its residual stream (post-norm) or an anatomy naming the
wrong modules breaks it, and is refused by name before any score is computed.
"""

from __future__ import annotations

import torch

from probe.circuits.parts import Parts
from probe.circuits.states import Recorder, SenderStates
from probe.circuits.task import Ablation, AnswerMetric, PairBatch
from probe.errors import ConfigError
from probe.hooks.forward import call
from probe.hooks.hookset import HookSet

TOLERANCE = 1e-3  # relative: the sum of the writes against the final residual


class BatchContext:
    """One batch's clean run and ablation values, each computed on first use."""

    def __init__(self, parts: Parts, batch: PairBatch, metric: AnswerMetric, ablation: Ablation):
        self.parts, self.batch, self.metric, self.ablation = parts, batch, metric, ablation
        self._clean: tuple[SenderStates, torch.Tensor, torch.Tensor] | None = None
        self._sources: SenderStates | None = None

    def check(self) -> None:
        """Run the clean forward now if the model's residual sum has not been checked yet."""
        if not self.parts.checked:
            self._run_clean()

    def set_clean(self, states: SenderStates, logits: torch.Tensor) -> None:
        """Take the clean states and logits from a run a method made anyway."""
        logits = logits.detach()
        values = self.metric(logits, logits, self.batch.side)
        self._clean = (states, logits, values)

    def _run_clean(self) -> None:
        hooks = HookSet("circuit clean run")
        check = not self.parts.checked
        with hooks, torch.no_grad():
            recorder = Recorder(self.parts, hooks)
            sums = _ResidualSum(self.parts, hooks) if check else None
            out = call(self.parts.model, self.batch.clean)
        if sums is not None:
            sums.verify(recorder)
            self.parts.checked = True
        logits = self.batch.logits(self.metric, out)
        self.set_clean(recorder.states(), logits)

    def _clean_run(self) -> tuple[SenderStates, torch.Tensor, torch.Tensor]:
        """(states, logits, metric) of the clean run, run now if not yet."""
        if self._clean is None:
            self._run_clean()
        assert self._clean is not None  # (set by _run_clean)
        return self._clean

    @property
    def clean_states(self) -> SenderStates:
        return self._clean_run()[0]

    @property
    def reference(self) -> torch.Tensor:
        """(N, V) float64: the clean logits at the metric's position."""
        return self._clean_run()[1]

    @property
    def clean_metric(self) -> torch.Tensor:
        return self._clean_run()[2]

    def score(self, output) -> torch.Tensor:
        """The metric per sample of a run's output, against the clean reference."""
        logits = self.batch.logits(self.metric, output)
        reference = self.reference if self._clean is not None else logits.detach()
        return self.metric(logits, reference, self.batch.side)

    @property
    def sources(self) -> SenderStates:
        """The values ablated edges carry: corrupt states, means or zeros."""
        if self._sources is None:
            kind = self.ablation.kind
            if kind == "counterfactual":
                hooks = HookSet("circuit corrupt run")
                with hooks, torch.no_grad():
                    recorder = Recorder(self.parts, hooks)
                    call(self.parts.model, self.batch.corrupt)
                self._sources = recorder.states()
            elif kind == "mean":
                device = self.clean_states.input.device
                assert self.ablation.means is not None  # Ablation refuses a mean without them
                self._sources = self.ablation.means.map(lambda t: t.to(device))
            else:
                self._sources = self.clean_states.zeros_like()
        return self._sources


class _ResidualSum:
    """Hooks keeping the attention output projections' outputs (bias included) and the final
    norm's input, to check that the writes add up to the final residual."""

    def __init__(self, parts: Parts, hooks: HookSet):
        self.parts = parts
        self.attn: dict[int, torch.Tensor] = {}  # each layer's attention output projection's
        self.final: torch.Tensor | None = None  # the final norm's input
        for i, layer in enumerate(parts.layers):
            hooks.forward(layer.attn_out, self._keep(i), name=layer.attn_out_name)
        hooks.forward_pre(parts.final_norm, self._final, name="final norm")

    def _keep(self, layer: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.attn.setdefault(layer, out.detach())

        return hook

    def _final(self, module, args):
        if self.final is None:
            self.final = args[0].detach()

    def verify(self, recorder: Recorder) -> None:
        n = len(self.parts.layers)
        assert recorder.input is not None and self.final is not None  # (the forward ran)
        total = recorder.input.double()
        for i in range(n):
            total = total + self.attn[i].double() + recorder.mlp[i].double()
        final = self.final.double()
        error = float((total - final).abs().max())
        scale = float(final.abs().max()) or 1.0
        if error > TOLERANCE * scale:
            raise ConfigError(
                f"circuits: in this {self.parts.family!r} model the residual stream at the final "
                "norm is not the sum of the input's, the attention output projections' and the "
                f"MLPs' writes (off by {error:.3g} of {scale:.3g}): a post-norm model (normalising "
                "inside the residual stream) has no edges to score; or model.anatomy names the "
                "wrong modules (attn_out: the attention's output projection, mlp_out: the MLP, "
                "final_norm: the norm before the unembedding)"
            )
