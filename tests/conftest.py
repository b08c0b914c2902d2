"""Shared fixtures, and the share of the cores each pytest-xdist worker takes."""

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from probe.stats.parallel import usable_cores
from probe.testing.compose import QUIET
from probe.testing.tiny_lms import make_tiny, make_tokenizer

# Nothing is downloaded: the HuggingFace hub answers at once that it is offline (a name it would
# look up, such as a custom model's as a tokenizer, otherwise waits out its retries), here and in
# every CLI run a test starts.
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_configure(config):
    """Under pytest-xdist (`-n auto`), each worker's torch, and the CLI runs it starts, use its
    share of the cores, so that the workers do not crowd each other out; tests of threads set
    the count they check themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        share = max(1, usable_cores() // workers)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)
    if "PYTEST_XDIST_WORKER" not in os.environ and not config.option.collectonly:
        _compile_kernels_while_collecting()


# the warm-up in a process of its own, which gives back kernel_cache's lock when it ends
_WARM_UP = """
import pathlib, sys
from probe.stats import kernel_cache
try:
    kernel_cache.warm_up()
finally:
    pathlib.Path(sys.argv[1]).unlink(missing_ok=True)
"""


def _compile_kernels_while_collecting() -> None:
    """In pytest's own process (xdist's controller, or the only one): where numba's kernels are
    not compiled yet, compile them once, at normal priority, in a process that holds
    probe.stats.kernel_cache's lock, while the workers start and collect; `compiled_kernels`
    waits for it. (Each worker compiling its own copy doubles the work.)"""
    from probe.stats import backend, kernel_cache

    if not backend.numba_installed() or kernel_cache.is_warm():
        return
    lock = kernel_cache.cache_dir() / f"kernels-{kernel_cache._key()}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists() and kernel_cache._lock_is_stale(lock):
            lock.unlink(missing_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:  # a compile holds it already, or the directory cannot be written
        return
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _WARM_UP, str(lock)], stdin=subprocess.DEVNULL
        )
    except OSError:
        os.close(fd)
        lock.unlink(missing_ok=True)
        return
    os.write(fd, str(child.pid).encode())
    os.close(fd)
    threading.Thread(target=child.wait, daemon=True).start()  # (reaped as soon as it ends)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped where torch sees no CUDA device (scripts/device_check.py
    runs them, `pytest -m cuda`, where one is lent)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """numba's kernels compiled before any test, where numba is installed: every run's
    stats.backend=auto then takes the same backend (in a fresh clone the first runs would use
    torch while the kernels compile in the background). A compile holding kernel_cache's lock
    (pytest_configure's) is waited for; without one, or if it ended without a stamp, this
    process compiles them."""
    from probe.stats import backend, kernel_cache

    if not backend.numba_installed():
        return
    lock = kernel_cache.cache_dir() / f"kernels-{kernel_cache._key()}.lock"
    deadline = time.monotonic() + kernel_cache.LOCK_STALE_SECONDS
    while not kernel_cache.is_warm() and lock.exists() and time.monotonic() < deadline:
        if kernel_cache._lock_is_stale(lock):
            break
        time.sleep(0.2)
    if not kernel_cache.is_warm():
        kernel_cache.warm_up()


@pytest.fixture
def cli_in_process(capfd, monkeypatch):
    """`python -m probe ARGS` through its console entry point in this process: Hydra's
    composition, every check, the message and the exit code as `tests.helpers.cli` gets them in
    a subprocess, without starting an interpreter. For a run that stops at bad input; returns a
    subprocess.CompletedProcess (returncode, stdout, stderr)."""
    from probe.__main__ import main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def call(*args: str) -> subprocess.CompletedProcess:
        flags = [a for a in args if a in ("-m", "--multirun")]
        argv = ["probe", *flags, *QUIET, *(a for a in args if a not in flags)]
        capfd.readouterr()  # (what the test printed before)
        with monkeypatch.context() as m:
            m.setattr(sys, "argv", argv)
            try:
                main()
                code = 0
            except SystemExit as e:  # as the interpreter turns it into an exit status
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            finally:  # Hydra's handlers write to this test's captured streams: drop them
                for handler in logging.root.handlers[:]:
                    logging.root.removeHandler(handler)
                    handler.close()
        out = capfd.readouterr()
        return subprocess.CompletedProcess(argv, code, out.out, out.err)

    return call


@pytest.fixture
def small_resnet():
    """Overrides for a quick resnet18 run: 7 samples of 64x64 in batches of 3 (the last one short)."""
    return [
        "model=resnet18",
        "dataset.image_size=64",
        "dataset.num_samples=7",
        "dataset.batch_size=3",
    ]


@pytest.fixture(scope="session")
def lm(tmp_path_factory):
    """A tiny GPT-2 and a pairs file: 5 pairs of 6 tokens differing at position 2, an answer
    and a wrong token each."""
    root = tmp_path_factory.mktemp("patching")
    model = make_tiny("gpt2", root / "gpt2", vocab_size=50)
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(3, 50, (5, 6), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 50, (5,), generator=g)
    pairs = {
        "clean_ids": clean,
        "corrupt_ids": corrupt,
        "answer": torch.randint(3, 50, (5,), generator=g),
        "wrong": torch.randint(3, 50, (5,), generator=g),
    }
    torch.save(pairs, root / "pairs.pt")
    return model, root / "pairs.pt", pairs


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """A tiny GPT-2 (vocabulary 40, pad id 0) saved with save_pretrained, and a tokenizer
    saved beside it: (model folder, tokenizer folder)."""
    root = tmp_path_factory.mktemp("tiny_gpt2")
    return make_tiny("gpt2", root / "gpt2", vocab_size=40), make_tokenizer(root / "tok")


@pytest.fixture(scope="module")
def resnet():
    """A seeded resnet18 with 10 classes, in eval mode (tests read it, never change it)."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """A tiny tokenizer saved with save_pretrained (see probe.testing.tiny_lms.make_tokenizer)."""
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)
