"""The checks the run's parse and the functions called from Python share, each written once:
probe.checks calls them on the plan (check_circuit, with the config's other checks), and
probe.circuits' and probe.intervene's functions call them on their arguments (attribute,
AnswerMetric, Ablation, pair_batch, exact_edges, the patching metrics), so a method, an
ablation, a metric, exact's edges, the steps and the answer tokens are refused in the same words
wherever they come from (docs/errors.md#circuits). No torch: the parse runs them before a model
is built.
"""

from __future__ import annotations

from collections.abc import Sequence

from probe.errors import ConfigError

# the answer tokens each metric reads (probe.intervene.metrics computes them; kl and
# output_change compare the whole next-token distribution and read none)
ANSWER_TOKENS = {
    "logit_diff": ("answer", "wrong"),
    "answer_logprob": ("answer",),
    "answer_prob": ("answer",),
}


def choice(key: str, value, known) -> None:
    """A ConfigError naming `key` where `value` is not one of `known`."""
    if value not in known:
        raise ConfigError(f"{key}={value!r} is unknown; choose from {', '.join(known)}")


def circuit_methods(methods, ablation: str, known: Sequence[str] | None = None) -> list[str]:
    """circuit.method (one method or a list), fit for the `ablation` kind and, with `known`
    (the registry's names in the order they run: probe.circuits.scores.METHODS, the one list a
    registered method joins), each known, in that order (eap's clean run serves the rest). The
    parse, which runs before any registry is imported, gives no `known`: the run checks the
    names against the registry before it builds the model."""
    methods = [methods] if isinstance(methods, str) else list(methods)
    if not methods:
        named = f"one or more of {', '.join(known)}" if known else "one or more methods"
        raise ConfigError(f"circuit.method is empty; give {named}")
    if known is not None:
        for m in methods:
            choice("circuit.method", m, known)
    if "eap_ig_inputs" in methods and ablation != "counterfactual":
        raise ConfigError(
            "circuit.method=eap_ig_inputs integrates from the corrupt input to the clean one, so "
            f"it needs circuit.ablation=counterfactual (got {ablation}); use "
            "eap_ig_activations for mean or zero ablation"
        )
    methods = list(dict.fromkeys(methods))
    return methods if known is None else sorted(methods, key=list(known).index)


def check_steps(steps) -> None:
    """circuit.steps, the integrated-gradient methods' steps: a whole number of at least 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(
            f"circuit.steps={steps!r} must be a whole number of at least 1 (the steps of the "
            "integrated-gradient methods)"
        )


def check_exact(count: int, max_exact: int | None, what: str = "edges") -> None:
    """circuit.max_exact: exact patching makes one forward per edge (or sender), `count` of them."""
    if max_exact is not None and count > max_exact:
        raise ConfigError(
            f"circuit.method=exact patches {count} {what}, one forward each, more than "
            f"circuit.max_exact={max_exact}; raise circuit.max_exact, or score with eap / "
            "eap_ig_* and patch the top edges exactly"
        )


def check_answers(label: str, metric: str, has) -> None:
    """The answer tokens metric `metric` reads (ANSWER_TOKENS) among the data's, `has`; `label`
    names the key in the message (circuit.metric=logit_diff, intervene.metrics: logit_diff)."""
    missing = [k for k in ANSWER_TOKENS.get(metric, ()) if k not in has]
    if missing:
        raise ConfigError(
            f"{label} reads the {' and '.join(missing)} tokens, which the data does not give; "
            "use dataset=pairs with answer and wrong in each record, or a metric that reads "
            "neither: kl, output_change"
        )
