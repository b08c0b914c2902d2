"""The error catalogue continued (docs/errors.md; tests/launch/test_error_catalogue.py holds its first
entries, tests/launch/conftest.py the `cli_here` fixture, which runs the real console entry point in this process and
checks that nothing printed a traceback and no hook is left on a model): token models and token
data, and the config values, objectives, probes and stores that a user can get wrong.

Each case checks the exit code and the key words of the message; one refused before any work
also that no probe.h5 was written, one stopped in the first batch that the file is closed as
incomplete with no sample.
"""

from __future__ import annotations

import importlib.util
import logging

import h5py
import pytest
import torch

from tests.launch.test_error_catalogue import TINYNET, assert_words

GRADS = "probes.everything.capture=[output,grad_output]"
EDIT = ["intervene=edit", "intervene.edit.layers=[conv]"]


@pytest.fixture(autouse=True)
def quiet_transformers():
    """In-process runs only: transformers' loggers keep handlers bound to the captured streams of
    earlier tests, closed by now, and a warning would print a logging error's traceback. The
    cases check probe's messages, never transformers' own."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def refused(cli_here, tmp_path, *args, words):
    """The run of `args` exits with code 2 and `words` before a file is written."""
    got, text = cli_here(*args)
    assert got == 2, text
    assert_words(text, *words)
    assert not (tmp_path / "run" / "probe.h5").exists()


def stopped_in_the_first_batch(tmp_path) -> None:
    """The file is there, closed as incomplete, and holds no sample."""
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        assert not f.attrs["complete"] and int(f.attrs["num_samples"]) == 0


# -- config values -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["seed=99999999999999999999"], ["seed=99999999999999999999 is out of range", "seed=0"]),
        (["dataset.num_workers=-1"], ["dataset.num_workers=-1 must be at least 0"]),
        (["model.num_classes=-1"], ["model.num_classes=-1 must be at least 1"]),
        (["model.num_classes=0"], ["model.num_classes=0 must be at least 1"]),
        (["dataset.num_samples=0"], ["dataset.num_samples=0 must be at least 1", "null"]),
        (["store.chunk_bytes=0"], ["store.chunk_bytes=0 must be at least 1"]),
        (["store.chunk_bytes=-5"], ["store.chunk_bytes=-5 must be at least 1"]),
        (["store.queue_batches=-1"], ["store.queue_batches=-1 must be at least 1"]),
        (["store.flush_seconds=-1"], ["store.flush_seconds=-1.0 must be at least 0"]),
        (["store.filename=../x.h5"], ["'../x.h5' is outside the run directory", "hydra.run.dir"]),
        (["model.library=keras"], ["model.library='keras' is not one of", "torchvision, hf"]),
        (["model._target_=no.such.Module"], ["'no.such.Module' cannot be imported", "dotted path"]),
        (["+model.kwargs.depth=3"], ["rejected model.kwargs={'depth': 3}", "depth"]),
        (["model._target_=os.getcwd"], ["'os.getcwd' built a str, not an nn.Module"]),
    ],
    ids=["seed", "num_workers", "num_classes", "num_classes-0", "num_samples", "chunk_bytes", "chunk_bytes-negative", "queue_batches",
         "flush_seconds", "filename-up", "library", "target-import", "kwargs", "target-no-module"],
)  # fmt: skip
def test_a_config_value_out_of_range_or_unknown(cli_here, tmp_path, args, words):
    refused(cli_here, tmp_path, *TINYNET, *args, words=words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["precision=fp8"], ["precision=fp8", "Invalid value 'fp8'", "fp32, bf16, fp16"]),
        (["store.model_output=some"], ["Invalid value 'some'", "auto, full, last, none"]),
        (["store.compression=zstd"], ["Invalid value 'zstd'", "none, lzf, gzip"]),
        (["store.mode=everything"], ["Invalid value 'everything'", "full, stats"]),
        (["stats.backend=gpu"], ["Invalid value 'gpu'", "auto, torch, numba"]),
    ],
    ids=["precision", "model_output", "compression", "mode", "backend"],
)
def test_a_value_outside_a_choice_fails_as_hydra_composes(cli_here, tmp_path, args, words):
    """Choices are enums of the schema: Hydra refuses another value at compose time, naming it,
    the key and the choices (its exit code 1, its message, no traceback), before any run folder."""
    got, text = cli_here(*TINYNET, *args)
    assert got == 1 and "Traceback" not in text, text
    assert_words(text, *words, args[0].split("=")[0])
    assert not (tmp_path / "run").exists()


def test_an_absolute_store_filename_is_refused(cli_here, tmp_path):
    elsewhere = tmp_path / "elsewhere" / "x.h5"
    refused(cli_here, tmp_path, *TINYNET, f"store.filename={elsewhere}",
            words=[f"store.filename='{elsewhere}'", "must live in the run directory",
                   "hydra.run.dir", "relative name"])  # fmt: skip
    assert not elsewhere.exists() and not elsewhere.parent.exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["probes.everything.dtype=float64"], ["dtype='float64' is unknown", "float32, float16"]),
        (["probes.everything.match=some"], ["match='some' is unknown", "all or any"]),
        (["probes.everything.capture=[]"], ["capture is empty", "output, input"]),
        (["probes.everything.unit_axis=0"], ["unit_axis=0", "auto", "-1"]),
        (["probes.everything.types=[conv2d]"], ["type 'conv2d'", "case-sensitive", "Conv2d"]),
        (["+probes.head.layers=fc"], ["layers='fc' is not a list", "probes.head.layers=[fc]"]),
        (
            ["probes.everything.rows=tokens", "probes.everything.reduce=token_mean"],
            ["rows: tokens keeps every token", "reduce: none"],
        ),
        (
            ["probes.everything.capture=[param_grad]"],
            ["layer 'relu' (ReLU) has no parameters", "probes.everything.exclude=[relu]",
             "grad_output"],
        ),
    ],
    ids=["dtype", "match", "capture-empty", "unit_axis-0", "types-case", "layers-not-a-list",
         "rows-tokens-reduced", "param_grad-without-parameters"],
)  # fmt: skip
def test_a_probe_that_cannot_capture_what_it_asks(cli_here, tmp_path, args, words):
    refused(cli_here, tmp_path, *TINYNET, *args, words=words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["intervene.edit.op=clamp"], ["op=clamp needs min and/or max", "intervene.edit.max"]),
        (["intervene.edit.op=noise", "intervene.edit.std=-1"], ["std=-1.0 must be >= 0"]),
        (["intervene.edit.op=zap"], ["op='zap' is unknown", "zero, scale"]),
        (["intervene.edit.op=zero", "intervene.edit.site=middle"], ["site='middle' is unknown"]),
    ],
    ids=["clamp", "noise-std", "op", "site"],
)
def test_an_edit_that_cannot_be_made(cli_here, tmp_path, args, words):
    refused(cli_here, tmp_path, *TINYNET, *EDIT, *args, words=words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_cuda_asked_for_where_there_is_none(cli_here, tmp_path):
    refused(cli_here, tmp_path, *TINYNET, "device=cuda",
            words=["device='cuda' but no CUDA device is available", "device=cpu"])  # fmt: skip


# -- datasets ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["dataset.resize=0"], ["dataset.resize=0 must be at least 1"]),
        (["dataset.crop=0"], ["dataset.crop=0 must be at least 1"]),
        (["dataset.std=[0,0,0]"], ["dataset.std=[0.0, 0.0, 0.0] must be > 0"]),
    ],
    ids=["resize", "crop", "std"],
)
def test_an_image_transform_that_cannot_be_applied(cli_here, tmp_path, args, words):
    root = tmp_path / "images" / "a"
    root.mkdir(parents=True)
    refused(cli_here, tmp_path, *TINYNET, "dataset=imagefolder", f"dataset.root={root.parent}",
            *args, words=words)  # fmt: skip


# -- objectives ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("targets", "words"),
    [
        (torch.rand(6), ["batch's targets are float32 of shape (2,)", "targets.long()"]),
        (torch.randint(0, 10, (6, 2)), ["batch's targets are int64 of shape (2, 2)", "shape (N,)"]),
    ],
    ids=["float", "2-D"],
)
def test_targets_cross_entropy_cannot_take(cli_here, tmp_path, targets, words):
    path = tmp_path / "data.pt"
    torch.save({"inputs": torch.randn(6, 3, 8, 8), "targets": targets}, path)
    code, text = cli_here(*TINYNET, GRADS, "dataset=tensors", f"dataset.path={path}")
    assert code == 2
    assert_words(text, "objective=cross_entropy takes integer class labels", *words,
                 "objective=output_sum")  # fmt: skip
    stopped_in_the_first_batch(tmp_path)


CUSTOM = ["objective=custom", GRADS]
MUST = "must be a callable (outputs, targets) -> a tensor of one loss per sample"


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("builtins.len", ["'builtins.len'", MUST, "takes (obj, /), not (outputs, targets)"]),
        ("math.pi", ["'math.pi' is not callable", MUST]),
    ],
    ids=["one-argument", "not-callable"],
)
def test_a_custom_objective_refused_before_the_run(cli_here, tmp_path, target, words):
    refused(cli_here, tmp_path, *TINYNET, *CUSTOM, f"objective._target_={target}", words=words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([*EDIT, "intervene.edit.op=zero", "intervene.edit.channels=[99]"],
         ["channels [99] are out of range for 'conv' output with 4 channels"]),
        (["probes.everything.reduce=token_mean"],
         ["reduce: token_mean needs token inputs (input_ids)", "dataset=tokens, text"]),
        (["probes.everything.rows=tokens"],
         ["rows: tokens needs token inputs (input_ids)", "dataset=tokens, text"]),
        (["probes.everything.unit_axis=5"],
         ["unit_axis=5 does not fit its 4-D layout", "1..3", "unit_axis: auto"]),
        ([*CUSTOM, "objective._target_=torch.sum"], ["'torch.sum'", "raised TypeError", MUST]),
        ([*CUSTOM, "objective._target_=torch.nn.functional.cross_entropy"],
         ["returned (), not one loss per sample (2,)", MUST, "reduction='none'"]),
        ([GRADS, "objective=lm_loss"],
         ["objective=lm_loss needs a language model's", "model.task=causal_lm"]),
    ],
    ids=["edit-channels", "token_mean", "rows-tokens", "unit_axis-5", "custom-raises",
         "custom-scalar", "lm_loss"],
)  # fmt: skip
def test_an_image_run_that_stops_in_its_first_batch(cli_here, tmp_path, args, words):
    code, text = cli_here(*TINYNET, *args)
    assert code == 2
    assert_words(text, *words)
    stopped_in_the_first_batch(tmp_path)


# -- models, checkpoints and weights -------------------------------------------------------------
RANDOM = ["dataset=random_tokens", "dataset.num_samples=2", "dataset.seq_len=4"]
HAS_TIMM = importlib.util.find_spec("timm") is not None


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([*TINYNET, "model.checkpoint={folder}"],
         ["model.checkpoint='{folder}' is a directory", "model.checkpoint={folder}/last.pt"]),
        ([*TINYNET, "model.checkpoint=/nonexistent/w.pt"],
         ["model.checkpoint='/nonexistent/w.pt' does not exist", ".pt state_dict"]),
        (["model=resnet18", "dataset.num_samples=2", "model.weights=BOGUS"],
         ["model.weights='BOGUS' is not a weights name of resnet18", "IMAGENET1K_V1"]),
        pytest.param(["model=timm", "model.name=resnet19", "dataset.num_samples=2"],
                     ["unknown timm model 'resnet19'", "resnet18"],
                     marks=pytest.mark.skipif(not HAS_TIMM, reason="timm is not installed")),
        (["model=hf", "model.name={folder}", *RANDOM],
         ["model.name='{folder}' is a directory without config.json", "save_pretrained"]),
        (["model=hf", "model.name=tiny", "model.pretrained=false",
          "+model.config.model_type=gpt9", *RANDOM],
         ["model.config.model_type='gpt9' is not a transformers model type", "gpt2"]),
        ([*TINYNET, "dataset=random_tokens"],
         ["dataset=random_tokens needs a vocabulary size", "dataset.vocab_size=N"]),
    ],
    ids=["checkpoint-folder", "checkpoint-missing", "weights", "timm", "hf-folder",
         "model_type", "no-vocabulary"],
)  # fmt: skip
def test_a_model_that_cannot_be_built(cli_here, tmp_path, args, words):
    """{folder} is a folder that holds last.pt and no config.json."""
    folder = tmp_path / "weights"
    folder.mkdir()
    torch.save({}, folder / "last.pt")
    args = [a.format(folder=folder) for a in args]
    refused(cli_here, tmp_path, *args, words=[w.format(folder=folder) for w in words])


# -- token models and token data -----------------------------------------------------------------
def lm_args(tiny_gpt2, *args: str) -> list[str]:
    return [
        "model=hf",
        f"model.name={tiny_gpt2[0]}",
        "model.task=causal_lm",
        "probes=residual",
        *args,
    ]


def text_args(tiny_gpt2, path, *args: str) -> list[str]:
    return lm_args(
        tiny_gpt2,
        "dataset=text",
        f"dataset.path={path}",
        f"dataset.tokenizer={tiny_gpt2[1]}",
        *args,
    )


LM_GRADS = [*RANDOM, "probes.residual.capture=[output,grad_output]"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["dataset=random_tokens", "dataset.seq_len=0"], ["dataset.seq_len=0 must be at least 1"]),
        (["model.task=causal"], ["model.task='causal' is not one of", "causal_lm"]),
        (["dataset=random_tokens", "dataset.vocab_size=1000"],
         ["dataset.vocab_size=1000 is beyond the model's vocabulary of 40", "at most 40"]),
        (["+model.config.n_layr=3", *RANDOM], ["model.config.n_layr", "GPT2Config", "n_layer"]),
        (LM_GRADS, ["objective=cross_entropy needs targets", "objective=output_sum"]),
    ],
    ids=["seq_len", "task", "vocab_size", "config-key", "no-targets"],
)  # fmt: skip
def test_a_token_config_that_cannot_run(cli_here, tmp_path, tiny_gpt2, args, words):
    refused(cli_here, tmp_path, *lm_args(tiny_gpt2, *args), words=words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["objective=logit", "objective.index=99"],
         ["objective.index=99 is out of range for a model output of 40 logits"]),
        (["objective=logit", "objective.index=3", "objective.position=9"],
         ["objective.position=9 is out of range for 4 tokens", "-4 <= position < 4"]),
    ],
    ids=["index", "position"],
)  # fmt: skip
def test_a_logit_the_output_does_not_have(cli_here, tmp_path, tiny_gpt2, args, words):
    code, text = cli_here(*lm_args(tiny_gpt2, *LM_GRADS, *args))
    assert code == 2
    assert_words(text, *words)
    stopped_in_the_first_batch(tmp_path)


def test_rows_longer_than_the_model_takes(cli_here, tmp_path, tiny_gpt2):
    code, text = cli_here(*lm_args(tiny_gpt2, "dataset=random_tokens", "dataset.seq_len=600"))
    assert code == 2
    assert_words(text, "forward raised IndexError", "input_ids (8, 600)", "dataset.seq_len")
    stopped_in_the_first_batch(tmp_path)


def test_a_token_unit_axis_beyond_the_layout(cli_here, tmp_path, tiny_gpt2):
    code, text = cli_here(*lm_args(tiny_gpt2, *RANDOM, "probes.residual.unit_axis=7"))
    assert code == 2
    assert_words(text, "layer 'transformer.h.0'", "unit_axis=7 does not fit its 3-D layout")
    stopped_in_the_first_batch(tmp_path)


@pytest.mark.parametrize(
    ("content", "suffix", "words"),
    [
        (b"", ".txt", ["holds no documents", "one document per non-empty line"]),
        (b"\n  \n\n", ".txt", ["holds no documents"]),
        (b"a,b\n", ".csv", ["unsupported suffix '.csv'", ".txt, .jsonl, .parquet"]),
        (b"\xff\xfe\x00bad", ".txt", ["is not UTF-8 text"]),
        (b'{"text": "the cat"}\nnot json\n', ".jsonl", ["line 2 is not JSON", "one JSON object"]),
        (b'["the cat"]\n', ".jsonl", ["line 1 is a JSON list, not an object"]),
        (b'{"text": 3}\n', ".jsonl", ["line 1: 'text' is a int, not text"]),
    ],
    ids=["empty", "blank-lines", "csv", "not-utf8", "not-json", "json-list", "not-text"],
)
def test_a_text_file_that_gives_no_documents(cli_here, tmp_path, tiny_gpt2, content, suffix, words):
    path = tmp_path / f"docs{suffix}"
    path.write_bytes(content)
    refused(cli_here, tmp_path, *text_args(tiny_gpt2, path), words=[str(path), *words])


def test_a_parquet_file_without_the_text_column(cli_here, tmp_path, tiny_gpt2):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    path = tmp_path / "docs.parquet"
    pq.write_table(pyarrow.table({"body": ["the cat sat"]}), path)
    refused(cli_here, tmp_path, *text_args(tiny_gpt2, path),
            words=["has no column 'text'", "['body']", "dataset.text_field"])  # fmt: skip


def test_a_tokenizer_folder_that_does_not_exist(cli_here, tmp_path, tiny_gpt2):
    path = tmp_path / "docs.txt"
    path.write_text("the cat sat\n")
    missing = tmp_path / "no_tokenizer"
    refused(
        cli_here,
        tmp_path,
        *lm_args(tiny_gpt2, "dataset=text", f"dataset.path={path}", f"dataset.tokenizer={missing}"),
        words=[f"dataset.tokenizer='{missing}' is not a directory", "save_pretrained"],
    )


@pytest.mark.parametrize("given", [False, True], ids=["model-folder", "empty-tokenizer-folder"])
def test_a_folder_without_tokenizer_files(cli_here, tmp_path, tiny_gpt2, given):
    """dataset=text tokenizes with model.name unless dataset.tokenizer is given; transformers
    would build an empty tokenizer from a model folder's config.json alone."""
    path = tmp_path / "docs.txt"
    path.write_text("the cat sat\n")
    empty = tmp_path / "tokenizer"
    empty.mkdir()
    source = (
        f"dataset.tokenizer='{empty}'" if given else f"model.name='{tiny_gpt2[0]}' (as tokenizer)"
    )
    named = [f"dataset.tokenizer={empty}"] if given else []
    refused(cli_here, tmp_path, *lm_args(tiny_gpt2, "dataset=text", f"dataset.path={path}", *named),
            words=[f"{source} is a folder without tokenizer files", "save_pretrained"])  # fmt: skip


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        (torch.tensor([[1.0, 2.0]]), ["token ids must be integers", "torch.float32", "ids.long()"]),
        (torch.tensor([1, 2, 3]), ["input_ids has shape (3,)", "ids.unsqueeze(0)"]),
        (torch.tensor([[1, -2, 3]]), ["token id -2 at sample 0 is negative"]),
        (
            {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 2)},
            ["attention_mask has shape (1, 2) but input_ids (1, 3)"],
        ),
        ({"ids": torch.tensor([[1, 2]])}, ["holds a dict with keys ['ids']", "'input_ids'"]),
    ],
    ids=["float", "1-D", "negative", "mask-shape", "no-input_ids"],
)
def test_a_token_file_of_the_wrong_structure(cli_here, tmp_path, tiny_gpt2, ids, words):
    path = tmp_path / "ids.pt"
    torch.save(ids, path)
    refused(cli_here, tmp_path, *lm_args(tiny_gpt2, "dataset=tokens", f"dataset.path={path}"),
            words=[str(path), *words])  # fmt: skip
