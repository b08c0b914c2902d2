"""probe's EAP edge scores against TransformerLens on the same tiny GPT-2 and Llama weights:
hannamw/EAP-IG's EAP algorithm run through TransformerLens's own hook points
(probe.testing.peers), per edge.

TransformerLens 4 (the one that installs beside transformers 5) has no HookedTransformer; its
TransformerBridge wraps the HuggingFace model, and with grouped-query attention its split key and
value inputs are per key/value head, as probe's receivers are. (auto-circuit 1.0.1, the other
peer, imports `transformer_lens.past_key_value_caching`, which TransformerLens 4 no longer has,
so it cannot run here.)"""

from __future__ import annotations

import numpy as np
import pytest

from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.testing.peers import bridge, edge_scores
from probe.testing.toy_circuits import pairs
from tests.circuits.hand import logit_diff
from tests.circuits.test_hand import build

# (importorskip's own reason, "could not import": device_check.py reads it as a missing library)
pytest.importorskip("transformer_lens")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eap_equals_eap_ig_on_transformer_lens_per_edge(family, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything it loads is local
    model = build(family)
    batch = pairs(50)
    theirs = edge_scores(bridge(model, tmp_path), batch, logit_diff)
    parts = parts_of(model)
    mine = dict(zip(parts.graph.edges, attribute(parts, [batch])["eap"].edges, strict=True))
    assert set(mine) == set(theirs)
    names = sorted(mine)
    a, b = np.array([mine[n] for n in names]), np.array([theirs[n] for n in names])
    assert np.abs(b).max() > 1e-2
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * np.abs(b).max())
