"""The training stream over a run's rows: every valid row once per epoch whatever the workers,
ranks and chunk sizes; a resumed stream gives the uninterrupted one's batches; rows mix across
sequences; memory is the buffer's, not the file's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import probe
from tests.helpers import ROOT, cli, run_probe

N, T = 1024, 16  # sequences x tokens: every token row holds (its sequence, its position)


@pytest.fixture(scope="module")
def ids_run(tmp_path_factory):
    """Token rows whose values are their own sequence and position (8 B a row), in chunks of 8
    rows (2048 chunks: enough for rank statistics over the chunk order) and of 1024 rows."""
    root = tmp_path_factory.mktemp("stream")
    ids = torch.arange(N)[:, None].expand(N, T).contiguous()
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, root / "ids.pt")
    out = {}
    for name, chunk in (("small", 64), ("large", 1 << 16)):
        _, f = run_probe(root / name, "model=custom", "model._target_=probe.testing.models.RowsOfIds",
                  "dataset=tokens", f"dataset.path={root / 'ids.pt'}", "dataset.batch_size=64",
                  "+probes.echo.layers=[echo]", "+probes.echo.rows=tokens", "probes=none",
                  f"store.chunk_bytes={chunk}")  # fmt: skip
        f.close()
        out[name] = root / name
    return out


def rows_of(batches) -> np.ndarray:
    return np.concatenate([b[0].numpy() for b in batches]).astype(np.int64)


@pytest.mark.parametrize("layout", ["small", "large"])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_valid_row_comes_once_per_epoch(ids_run, layout, workers):
    with probe.open_run(ids_run[layout]) as run:
        stream = run.dataset("echo", batch_size=50, seed=1, buffer_rows=200)
        loader = DataLoader(stream, batch_size=None, num_workers=workers)
        for epoch in (0, 1):
            stream.set_epoch(epoch)
            got = rows_of(loader)
            assert len(got) == N * T
            assert len({tuple(r) for r in got}) == N * T  # no row twice, none missing


def test_world_sizes_split_the_rows_between_ranks(ids_run, tmp_path):
    """Two processes with gloo: their rows together are every row, once."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, sys\nimport numpy as np, torch, torch.distributed as dist\n"
        "import probe\n"
        "dist.init_process_group('gloo')\n"
        f"run = probe.open_run({str(ids_run['small'])!r})\n"
        "stream = run.dataset('echo', batch_size=40, seed=3, buffer_rows=160)\n"
        "rows = np.concatenate([b[0].numpy() for b in stream]).astype(int).tolist()\n"
        "json.dump(rows, open(sys.argv[1] + f'.{dist.get_rank()}', 'w'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(tmp_path / "rows")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    parts = [json.loads((tmp_path / f"rows.{r}").read_text()) for r in (0, 1)]
    assert all(parts) and len(parts[0]) + len(parts[1]) == N * T
    assert {tuple(r) for r in parts[0] + parts[1]} == {(n, t) for n in range(N) for t in range(T)}


def test_a_resumed_stream_gives_the_uninterrupted_batches(ids_run):
    with probe.open_run(ids_run["small"]) as run:
        whole = [b[0] for b in run.dataset("echo", batch_size=37, seed=5, buffer_rows=150)]
        stream = run.dataset("echo", batch_size=37, seed=5, buffer_rows=150)
        first = []
        for i, batch in enumerate(stream):
            first.append(batch[0])
            if i == 6:
                state, arrays = stream.state_dict(), stream.state_dict(arrays=True)
                break
        again = run.dataset("echo", batch_size=37, seed=5, buffer_rows=150)
        again.load_state_dict(json.loads(json.dumps(state)))  # (a state survives JSON)
        rest = [b[0] for b in again]
        # the checkpoints' form: the held rows as one int64 array (as a tensor in probe.fit's)
        assert arrays["held"].dtype == np.int64 and arrays["held"].tolist() == state["held"]
        from_arrays = run.dataset("echo", batch_size=37, seed=5, buffer_rows=150)
        from_arrays.load_state_dict({**arrays, "held": torch.from_numpy(arrays["held"])})
        rest_from_arrays = [b[0] for b in from_arrays]
    assert len(first) + len(rest) == len(whole) and len(state["held"]) > 0
    for got, want in zip(first + rest, whole, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(rest_from_arrays, rest, strict=True):
        assert torch.equal(got, want)


def test_without_shuffle_rows_come_in_file_order_with_their_index(ids_run):
    with probe.open_run(ids_run["small"]) as run:
        batches = list(run.dataset("echo", batch_size=100, shuffle=False, with_index=True))
        token_ids = run.file["tokens/id"][:]
    rows = rows_of(batches)
    want = np.stack([np.repeat(np.arange(N), T), np.tile(np.arange(T), N)], 1)
    np.testing.assert_array_equal(rows, want)
    index = {k: np.concatenate([b[2][k].numpy() for b in batches]) for k in batches[0][2]}
    np.testing.assert_array_equal(index["sample"], want[:, 0])
    np.testing.assert_array_equal(index["position"], want[:, 1])
    np.testing.assert_array_equal(index["token"], token_ids)


def mixing(batches) -> tuple[float, float]:
    """(share of same-sequence pairs within batches over the uniform expectation, Spearman of the
    emitted order against the file order)."""
    same = pairs = 0
    for b in batches:
        seq = b[0][:, 0].long()
        counts = torch.bincount(seq, minlength=N).double()
        same += float((counts * (counts - 1)).sum())
        pairs += len(seq) * (len(seq) - 1)
    uniform = (T - 1) / (N * T - 1)
    order = rows_of(batches)
    position = order[:, 0] * T + order[:, 1]
    rank = np.argsort(np.argsort(position))
    spearman = np.corrcoef(rank, np.arange(len(rank)))[0, 1]
    return (same / pairs) / uniform, spearman


def test_rows_mix_across_sequences_and_the_file(ids_run):
    with probe.open_run(ids_run["small"]) as run:
        shuffled = list(run.dataset("echo", batch_size=64, seed=2, buffer_rows=N * T // 2))
        one_chunk = list(run.dataset("echo", batch_size=64, seed=2, buffer_rows=8))
        in_order = list(run.dataset("echo", batch_size=64, shuffle=False))
    share, spearman = mixing(shuffled)
    assert share <= 2.0 and abs(spearman) < 0.05
    control_share, _ = mixing(one_chunk)  # a one-chunk buffer: batches of few sequences
    assert control_share > 5.0
    assert mixing(in_order)[1] == pytest.approx(1.0)


def _peak_above_reader(tmp_path, buffer_rows: int, file_rows: int) -> int:
    """The peak RSS of a fresh process while it streams `file_rows` rows of 1 KB through a
    `buffer_rows` buffer, above its RSS with the reader opened."""
    script = tmp_path / "rss.py"
    script.write_text(
        "import json, sys, numpy as np, h5py, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from probe.read.stream import RowStream, Source\n"
        "import probe.store.runfile  # (its code is not the buffer's memory)\n"
        "path, buffer_rows, rows = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])\n"
        "with h5py.File(path, 'w') as f:\n"
        "    ds = f.create_dataset('rows', (rows, 256), 'f4', chunks=(1024, 256))\n"
        "    for at in range(0, rows, 8192):\n"
        "        ds[at:at + 8192] = np.random.rand(min(8192, rows - at), 256).astype('f4')\n"
        "def status(key):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(key): return int(line.split()[1]) * 1024\n"
        "stream = RowStream([Source(path, 'rows', [(0, rows)], 1024, row_bytes=1024)],\n"
        "                   batch_size=1024, buffer_rows=buffer_rows)\n"
        "torch.randperm(1 << 14, generator=torch.Generator())  # (torch set-up on first use: not ours)\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = status('VmRSS')\n"
        "seen = sum(len(b[0]) for b in stream)\n"
        "print(json.dumps({'rows': seen, 'above': status('VmHWM') - base}))\n"
    )
    path = tmp_path / f"rows{file_rows}.h5"
    # every block of 128 KB or more its own mapping, handed back when freed: the peak is what
    # the stream touches, not what the allocator happened to keep from the file's writing
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, str(script), str(path), str(ROOT), str(buffer_rows), str(file_rows)],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == file_rows
    path.unlink()
    return got["above"]


def test_memory_is_the_buffers_not_the_files(tmp_path):
    """The peak RSS above the opened reader, streaming a file 10x the buffer, stays below
    1.5 x (buffer + chunk): 32 MB of buffer over 320 MB. It is the buffer's, not the file's: a 4x
    larger file (40 -> 160 MB) adds under 1 MB; 7 MB more buffer adds 0.8-1.25 x 7 MB."""
    mb = 1 << 20
    ten_times = _peak_above_reader(tmp_path, 32768, 327680)
    assert ten_times < 1.5 * (32 + 1) * mb, ten_times
    small_file, big_file = (_peak_above_reader(tmp_path, 4096, rows) for rows in (40960, 163840))
    assert big_file - small_file < 1 * mb, (small_file, big_file)
    small_buffer, big_buffer = (_peak_above_reader(tmp_path, rows, 40960) for rows in (1024, 8192))
    assert 0.8 * 7 * mb < big_buffer - small_buffer < 1.25 * 7 * mb, (small_buffer, big_buffer)


def test_only_the_rows_a_module_produced_and_the_file_counts(tmp_path):
    """A module that skips batches: the stream gives its seen rows only (no NaN row); a run
    killed in its third batch: the rows /progress counts, and its labels with them."""
    from probe.launch.run import run
    from probe.testing.compose import make_cfg
    from tests.helpers import cli
    from tests.store.test_live_files import BRANCHY

    run(make_cfg(*BRANCHY), run_dir=tmp_path / "branchy")
    with probe.open_run(tmp_path / "branchy") as r:
        seen, rare = r.seen("rare", "output"), r.array("rare", "output")[:]
        targets = r.file["samples/target"][: r.num_samples]
        batches = list(r.dataset("rare", batch_size=5, shuffle=False, with_index=True))
    rows = np.concatenate([b[0].numpy() for b in batches])
    index = np.concatenate([b[2]["sample"].numpy() for b in batches])
    np.testing.assert_array_equal(index, np.flatnonzero(seen))
    np.testing.assert_array_equal(rows, rare[seen])
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in batches]), targets[seen])
    out = cli("model=custom", "model._target_=probe.testing.models.DiesOnThirdBatch",
              "model.input_shape=[3,8,8]", "model.num_classes=10", "dataset.num_samples=10",
              "dataset.batch_size=2", "probes=all_convs", f"hydra.run.dir={tmp_path / 'killed'}")  # fmt: skip
    assert out.returncode == 9
    with probe.open_run(tmp_path / "killed") as r:
        got = np.concatenate([b[0].numpy() for b in r.dataset("conv", shuffle=False)])
        want = r.file["layers/conv/output"][:4]
    np.testing.assert_array_equal(got, want)


def test_a_sweep_streams_every_run(tmp_path):
    """`open_sweep(...).dataset` concatenates the runs: each row of each run once, `source`
    naming the run."""
    ids = torch.arange(64)[:, None].expand(64, 4).contiguous()
    torch.save({"input_ids": ids}, tmp_path / "ids.pt")
    out = cli("-m", "model=custom", "model._target_=probe.testing.models.RowsOfIds", "dataset=tokens",
              f"dataset.path={tmp_path / 'ids.pt'}", "dataset.num_samples=16,48", "probes=none",
              "+probes.echo.layers=[echo]", "+probes.echo.rows=tokens", f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    sweep = probe.open_sweep(tmp_path / "sweep")
    batches = list(sweep.dataset("echo", batch_size=30, seed=4, buffer_rows=60, with_index=True))
    rows = np.concatenate([b[0].numpy() for b in batches]).astype(int)
    source = np.concatenate([b[2]["source"].numpy() for b in batches])
    got = sorted(zip(source.tolist(), map(tuple, rows.tolist()), strict=True))
    want = sorted(
        (r, (n, t)) for r, count in ((0, 16), (1, 48)) for n in range(count) for t in range(4)
    )
    assert got == want


def test_runs_of_other_shapes_are_not_one_stream():
    from probe.errors import DataError
    from probe.read.stream import RowStream, Source

    parts = [
        Source("a.h5", "x", [(0, 4)], 4, shape=(8,)),
        Source("b.h5", "x", [(0, 4)], 4, shape=(16,)),
    ]
    with pytest.raises(DataError) as e:
        RowStream(parts)
    assert (
        "(8,)" in str(e.value)
        and "(16,)" in str(e.value)
        and "open_run(path).dataset" in str(e.value)
    )


def test_plain_chunk_reads_equal_hdf5_reads(ids_run, tmp_path, monkeypatch):
    """Chunks read at their file offsets give the batches h5py's reads give, and a compressed
    file (read by h5py) the same rows."""
    from probe.read import chunk_reads

    def batches(path):
        with probe.open_run(path) as run:
            stream = run.dataset("echo", batch_size=64, seed=7, buffer_rows=300, with_index=True)
            return [(b[0], b[2]["token"]) for b in stream]

    plain = batches(ids_run["small"])
    monkeypatch.setattr(chunk_reads, "PLAIN_READS", False)
    through_h5py = batches(ids_run["small"])
    for (a, i), (b, j) in zip(plain, through_h5py, strict=True):
        assert torch.equal(a, b) and torch.equal(i, j)
    monkeypatch.setattr(chunk_reads, "PLAIN_READS", True)
    _, f = run_probe(tmp_path / "lzf", "model=custom", "model._target_=probe.testing.models.RowsOfIds",
                     "dataset=tokens", f"dataset.path={ids_run['small'].parent / 'ids.pt'}",
                     "dataset.batch_size=64", "+probes.echo.layers=[echo]", "+probes.echo.rows=tokens",
                     "probes=none", "store.chunk_bytes=64", "store.compression=lzf")  # fmt: skip
    f.close()
    compressed = batches(tmp_path / "lzf")
    for (a, _), (b, _) in zip(plain, compressed, strict=True):
        assert torch.equal(a, b)


def test_labels_chunked_otherwise_than_the_rows(tmp_path, monkeypatch):
    """Rows of 80 B in 4-row chunks, labels of 8 B in 42-row ones (84 tokens a batch), so a
    rows chunk may straddle two labels chunks: each row keeps its label, read plainly or through
    h5py."""
    from probe.read import chunk_reads

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(20, (48, 7), generator=g)
    torch.save({"input_ids": ids, "token_labels": ids % 3}, tmp_path / "ids.pt")
    _, f = run_probe(tmp_path / "run", "model=custom", "model._target_=probe.testing.models.TokenContext",
                     "dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}", "dataset.batch_size=12",
                     "+probes.t.layers=[lexical]", "+probes.t.rows=tokens", "probes=none",
                     "store.chunk_bytes=400")  # fmt: skip
    with f:
        assert (f["layers/lexical/output"].chunks[0], f["tokens/label"].chunks[0]) == (4, 42)
    for plain in (True, False):
        monkeypatch.setattr(chunk_reads, "PLAIN_READS", plain)
        with probe.open_run(tmp_path / "run") as run:
            batches = list(run.dataset("lexical", batch_size=33, seed=1, buffer_rows=70))
        rows = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        assert len(rows) == ids.numel()
        assert torch.equal(rows.argmax(1) % 3, labels)  # (the row is its token's one-hot)


@pytest.mark.cuda
def test_batches_reach_the_gpu_as_they_are(ids_run):
    """device=cuda: pinned host batches copied without blocking, equal to the CPU's."""
    with probe.open_run(ids_run["small"]) as run:
        on_cpu = list(run.dataset("echo", batch_size=64, seed=3, buffer_rows=256))
        on_gpu = list(run.dataset("echo", batch_size=64, seed=3, buffer_rows=256, device="cuda"))
    assert all(b[0].is_cuda for b in on_gpu)
    for (a, _), (b, _) in zip(on_cpu, on_gpu, strict=True):
        assert torch.equal(a, b.cpu())
