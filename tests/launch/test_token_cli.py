"""Bad token-model input from the command line: each a one-line message naming the value, exit
2, no traceback, and nothing of a run lost. Most go through the console entry point in this
process (`cli_in_process`); a missing extra needs a process of its own."""

from __future__ import annotations

import json

import h5py
import torch

from tests.helpers import ROOT, cli


def run_lm(call, tiny_gpt2, tmp_path, *args):
    """`call` (the CLI in a subprocess or in this process) on the tiny GPT-2."""
    model, _ = tiny_gpt2
    return call(
        "model=hf", f"model.name={model}", "model.task=causal_lm",
        f"hydra.run.dir={tmp_path / 'run'}", *args,
    )  # fmt: skip


def assert_message(out, *words):
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    message = out.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in message, message


def test_ids_beyond_the_vocabulary(tiny_gpt2, tmp_path, cli_in_process):
    path = tmp_path / "ids.pt"
    torch.save(torch.tensor([[1, 2, 3], [4, 70, 5]]), path)
    data = ["dataset=tokens", f"dataset.path={path}", "probes=residual"]
    out = run_lm(cli_in_process, tiny_gpt2, tmp_path, *data)
    assert_message(out, "70", "sample 1", "vocabulary of 40")


def test_a_text_file_without_the_named_field(tiny_gpt2, tmp_path, cli_in_process):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "the cat sat"}) + "\n" + json.dumps({"body": "a dog"}))
    data = ["dataset=text", f"dataset.path={path}", "probes=residual"]
    out = run_lm(cli_in_process, tiny_gpt2, tmp_path, *data)
    assert_message(out, "line 2", "text", "body", "dataset.text_field")


def test_token_rows_without_a_mask_where_padding_exists(tiny_gpt2, tmp_path, cli_in_process):
    """Ids holding the model's pad token (0) and no attention_mask: rows: tokens cannot tell
    padding from tokens; the file is never created."""
    path = tmp_path / "ids.pt"
    torch.save({"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]])}, path)
    data = ["dataset=tokens", f"dataset.path={path}", "probes=residual"]
    out = run_lm(cli_in_process, tiny_gpt2, tmp_path, *data)
    assert_message(out, "rows: tokens", "pad token 0", "attention_mask")
    assert not (tmp_path / "run" / "probe.h5").exists()


def test_a_model_name_that_is_neither_a_folder_nor_reachable(tmp_path, cli_in_process):
    out = cli_in_process(
        "model=hf", "model.name=no-such-org/no-such-model", f"hydra.run.dir={tmp_path}"
    )
    assert_message(out, "no-such-org/no-such-model", "model.name=DIR")


def test_a_missing_extra_names_it(tiny_gpt2, tmp_path):
    """With transformers absent (a package of that name that fails to import, first on the
    path), model.library=hf says which extra installs it."""
    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('transformers is not installed')\n")
    model, _ = tiny_gpt2
    out = cli(
        "model=hf", f"model.name={model}", f"hydra.run.dir={tmp_path / 'run'}",
        env={"PYTHONPATH": f"{tmp_path / 'shadow'}:{ROOT}"},
    )  # fmt: skip
    assert_message(out, "transformers", "pip install -e '.[hf]'")


def test_a_text_run_tokenizes_with_the_named_tokenizer(tiny_gpt2, tmp_path):
    """dataset=text with dataset.tokenizer=DIR: /tokens/id holds the tokenizer's own ids."""
    from transformers import AutoTokenizer

    model, tokenizer = tiny_gpt2
    path = tmp_path / "docs.txt"
    path.write_text("the cat sat on the mat\n\na big red dog ran\n")
    out = run_lm(
        cli, tiny_gpt2, tmp_path, "dataset=text", f"dataset.path={path}", f"dataset.tokenizer={tokenizer}",
        "probes=residual",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tok = AutoTokenizer.from_pretrained(tokenizer)
    want = [i for line in ("the cat sat on the mat", "a big red dog ran") for i in tok.encode(line)]
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        assert f["tokens/id"][:].tolist() == want
        assert f["layers/transformer.h.0/output"].shape == (len(want), 32)


def test_a_sweep_of_token_runs_summarizes_into_one_table(tiny_gpt2, tmp_path):
    """-m over rows: samples,tokens: probe.read.summaries gives one table whose rows count samples in
    one run and tokens in the other, each equal to its run's summary.csv."""
    import subprocess
    import sys

    import pandas as pd

    model, _ = tiny_gpt2
    ids = tmp_path / "ids.pt"
    torch.save({"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
                "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}, ids)  # fmt: skip
    out = cli(
        "-m", "model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=tokens",
        f"dataset.path={ids}", "probes=residual", "probes.residual.rows=samples,tokens",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    done = subprocess.run(
        [sys.executable, "-m", "probe.summarize", str(tmp_path / "sweep")],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(tmp_path / "sweep" / "summary.csv", dtype={"shape": str})
    rows = table.groupby("probes.residual.rows")["rows"].unique()
    assert list(rows["samples"]) == [2] and list(rows["tokens"]) == [5]
    for job in ("0", "1"):
        own = pd.read_csv(tmp_path / "sweep" / job / "summary.csv", dtype={"shape": str})
        mine = table[table.run == int(job)][own.columns].reset_index(drop=True)
        pd.testing.assert_frame_equal(mine, own, check_exact=False, rtol=1e-12)


def test_lm_loss_on_a_model_without_vocabulary_logits(tiny_gpt2, tmp_path, cli_in_process):
    """A base model returns hidden states (width 32) for ids up to 39: not logits to predict
    them with."""
    model, _ = tiny_gpt2
    path = tmp_path / "ids.pt"
    torch.save(torch.tensor([[1, 2, 39], [4, 5, 6]]), path)
    out = cli_in_process(
        "model=hf", f"model.name={model}", "model.task=base", "dataset=tokens",
        f"dataset.path={path}", "probes=residual", "probes.residual.capture=[grad_output]",
        "objective=lm_loss", f"hydra.run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert_message(out, "lm_loss", "32 entries", "reach 39", "model.task=causal_lm")
