"""Examples per unit (stats.topk, stats.bottomk, stats.topk_quantiles): equal to a brute-force
selection over the run's stored rows (value desc, row asc) whatever the batch size, batch order,
process count or resume; padding never among them; contexts are the token ids around."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import probe
from probe.hooks.batch_topk import POSITION_BITS, TopKSpec, partial, priority, row_keys
from probe.launch.run import run
from probe.stats.topk import TopKState, best
from probe.store import stats_file
from probe.testing.compose import make_cfg
from tests.helpers import run_interrupted, run_probe

SPEC = TopKSpec(top=4, bottom=3, quantiles=2, seed=0)
EXAMPLES = ["stats.topk=4", "stats.bottomk=3", "stats.topk_quantiles=2"]
IMAGES = ["model=custom", "model._target_=probe.testing.models.TinyNet", "model.input_shape=[3,8,8]",
          "model.num_classes=10", "dataset.num_samples=20", "probes=all_convs", *EXAMPLES]  # fmt: skip


def brute_force(rows: np.ndarray, first_keys: np.ndarray, spec: TopKSpec, units_axis: int = 1):
    """Every kind's selection over the whole matrix at once: rows (N, C, ...) with units on
    axis 1, keys sample * 2**20 + flattened position."""
    x = np.moveaxis(rows.astype(np.float64), units_axis, 1)
    n, c = x.shape[:2]
    inner = int(np.prod(x.shape[2:], dtype=np.int64))
    keys = (first_keys[:, None] + np.arange(inner)).reshape(-1)
    values = np.moveaxis(x.reshape(n, c, inner), 1, 0).reshape(c, -1)
    return {
        k: best(k, values, np.broadcast_to(keys, values.shape).copy(), spec) for k in spec.sizes()
    }


def kept(path, layer="conv", site="output"):
    with probe.open_run(path) as r:
        return stats_file.read(r.file)[(layer, site)].topk.kinds


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for kind in want:
        np.testing.assert_array_equal(got[kind][1], want[kind][1], err_msg=kind)
        np.testing.assert_array_equal(got[kind][0], want[kind][0], err_msg=kind)


@pytest.mark.parametrize("batch", [1, 6, 20])
def test_examples_equal_a_brute_force_selection(tmp_path, batch):
    """Conv maps (ties at ReLU's zeros for the bottom-k): keys sample * 2**20 + y * W + x."""
    _, f = run_probe(tmp_path, *IMAGES, f"dataset.batch_size={batch}")
    with f:
        rows, index = f["layers/conv/output"][:], f["samples/index"][:]
    assert_same(kept(tmp_path), brute_force(rows, index.astype(np.int64) << POSITION_BITS, SPEC))
    with probe.open_run(tmp_path) as r:
        table = r.topk("conv", unit=2)
    top = rows[:, 2].reshape(len(rows), -1)
    for _, row in table.iterrows():  # the table reads back the values where they are
        assert top[int(row["sample"]), int(row["y"]) * 8 + int(row["x"])] == pytest.approx(
            row["value"]
        )
    assert list(table["value"]) == sorted(table["value"], reverse=True)


def test_batch_order_does_not_matter():
    """Batches merged in any order (and in one piece) keep the same rows, ties included."""
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=(30, 5, 7)), 1).astype(np.float32)  # (N, T, C): many ties
    want = None
    for size in (1, 4, 30):
        starts = list(range(0, 30, size))
        rng.shuffle(starts)
        state = TopKState(SPEC)
        for lo in starts:
            found = row_keys(torch.from_numpy(x[lo : lo + size]), 2, lo, None, False)
            state.merge({k: (v.numpy(), i.numpy()) for k, (v, i) in partial(*found, SPEC).items()})
        want = want or brute_force(x, np.arange(30, dtype=np.int64) << POSITION_BITS, SPEC, 2)
        assert_same(state.kinds, want)


def test_the_sample_hash_is_the_same_in_torch_and_numpy():
    keys = np.array([0, 1 << 20, (7 << 20) + 3, 123456789012345], np.int64)
    units = np.arange(4)[:, None]
    np.testing.assert_array_equal(
        priority(torch.from_numpy(keys)[None], torch.from_numpy(units), 5).numpy(),
        priority(keys[None], units, 5),
    )


def test_one_batch_selection_against_numpy_on_hard_values():
    """A batch's top-k and bottom-k per unit (one partial) against numpy's (value, row) sort:
    ties at the k-th value, -0.0 beside 0.0, NaN and inf rows, a unit with no finite row and one
    with fewer than k."""
    rng = np.random.default_rng(3)
    v = np.round(rng.normal(size=(64, 6)), 0).astype(np.float32)  # few distinct values: ties
    v[::5, 1] = -0.0
    v[3, 2], v[9, 2], v[:, 4] = np.nan, np.inf, np.nan
    v[2:, 5] = np.nan  # two finite rows, k = 5
    keys = torch.arange(64, dtype=torch.int64) * 3 + 7  # ascending, as row_keys makes them
    spec = TopKSpec(top=5, bottom=5)
    got = partial(torch.from_numpy(v), keys, None, spec)
    for kind, sign in (("top", 1), ("bottom", -1)):
        for u in range(v.shape[1]):
            finite = np.flatnonzero(np.isfinite(v[:, u]))
            order = finite[np.lexsort((finite, -sign * v[finite, u].astype(np.float64)))][:5]
            want_keys = np.full(5, -1)
            want_keys[: len(order)] = order * 3 + 7
            have = got[kind][1][u].numpy()
            np.testing.assert_array_equal(np.sort(have), np.sort(want_keys), err_msg=f"{kind} {u}")


def test_padding_never_appears_even_when_loudest(tmp_path):
    """PadLoud's padded positions hold 100 + ...: the largest values of the capture. Token rows
    and a (N, T, C) capture per sample keep only real tokens; contexts are the ids around."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (12, 9), generator=g)
    lengths = torch.randint(3, 10, (12,), generator=g)
    mask = (torch.arange(9)[None] < lengths[:, None]).long()
    torch.save({"input_ids": ids * mask, "attention_mask": mask}, tmp_path / "ids.pt")
    _, f = run_probe(tmp_path / "run", "model=custom", "model._target_=probe.testing.models.PadLoud",
                     "dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}", "dataset.batch_size=5",
                     "+probes.rows.layers=[loud]", "+probes.rows.rows=tokens", "probes=none",
                     "stats.topk=6", "stats.topk_quantiles=2")  # fmt: skip
    f.close()
    spec = TopKSpec(top=6, quantiles=2)
    with probe.open_run(tmp_path / "run") as r:
        tokens = r.tokens()
        rows = r.array("loud", "output")[:]
        got = stats_file.read(r.file)[("loud", "output")].topk.kinds
        table = r.topk("loud", unit=[3, 5], context=(2, 1))
    first = (tokens["sample"].to_numpy() << POSITION_BITS) + tokens["position"].to_numpy()
    assert_same(got, brute_force(rows, first.astype(np.int64), spec))
    assert (got["top"][0] < 50).all()  # no padded position
    real = {(s, p) for s, p in zip(tokens["sample"], tokens["position"], strict=True)}
    assert {(r["sample"], r["position"]) for _, r in table.iterrows()} <= real
    for _, row in table.iterrows():
        s, p = row["sample"], row["position"]
        assert row["token_id"] == ids[s, p]
        around = ids[s, max(0, p - 2) : min(int(lengths[s]), p + 2)].tolist()
        assert row["context"].replace("[[", " ").replace("]]", " ").split() == [
            f"<{i}>" for i in around
        ]


def test_a_resumed_run_keeps_the_uninterrupted_examples(tmp_path):
    args = [*IMAGES, "model._target_=probe.testing.models.SignalsItself", "dataset.batch_size=3"]
    reference = run(make_cfg(*args), run_dir=tmp_path / "reference")
    run_interrupted(tmp_path / "run", 3, *args)
    run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")
    assert_same(kept(tmp_path / "run"), kept(reference.h5_path.parent))
    stats = [*args, "store.mode=stats"]  # (statistics-only: the examples resume from /topk)
    run(make_cfg(*stats), run_dir=tmp_path / "stats_reference")
    run_interrupted(tmp_path / "stats", 3, *stats, "store.flush_seconds=0")
    run(make_cfg(*stats, "resume=true"), run_dir=tmp_path / "stats")
    assert_same(kept(tmp_path / "stats"), kept(tmp_path / "stats_reference"))
    from probe.errors import ConfigError

    with pytest.raises(ConfigError, match="stats.topk: 4 in the file, 5 now"):  # (other examples)
        run(make_cfg(*args, "stats.topk=5", "resume=true"), run_dir=tmp_path / "run")


def test_more_examples_than_rows_is_refused(tmp_path, cli_in_process):
    head = [a for a in IMAGES if not a.startswith("probes=")] + [
        "probes=none",
        "+probes.head.layers=[fc]",
    ]
    out = cli_in_process(*head, "stats.topk=21", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stderr
    message = out.stderr.strip().splitlines()[-1]
    assert "stats.topk=21" in message and "20 rows" in message and "'fc'" in message
    out = cli_in_process(*IMAGES, "stats.bottomk=-1", f"hydra.run.dir={tmp_path / 'b'}")
    assert out.returncode == 2 and "stats.bottomk=-1 must be at least 0" in out.stderr


@pytest.mark.cuda
def test_examples_on_the_gpu_equal_the_cpus(tmp_path):
    """Reduced where the tensors live: a GPU run keeps the CPU run's examples (PadLoud's values
    are exact on both), and an SAE's latents on the GPU are the CPU's."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 20, (12, 9), generator=g)
    mask = (torch.arange(9)[None] < torch.randint(3, 10, (12, 1), generator=g)).long()
    torch.save({"input_ids": ids * mask, "attention_mask": mask}, tmp_path / "ids.pt")
    args = ["model=custom", "model._target_=probe.testing.models.PadLoud", "dataset=tokens",
            f"dataset.path={tmp_path / 'ids.pt'}", "dataset.batch_size=5", "+probes.rows.layers=[loud]",
            "+probes.rows.rows=tokens", "probes=none", "stats.topk=6", "stats.bottomk=2",
            "stats.topk_quantiles=2"]  # fmt: skip
    run_probe(tmp_path / "gpu", *args, "device=cuda")[1].close()
    run_probe(tmp_path / "cpu", *args)[1].close()
    assert_same(kept(tmp_path / "gpu", "loud"), kept(tmp_path / "cpu", "loud"))
