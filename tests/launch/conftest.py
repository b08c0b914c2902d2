"""Fixtures the launch tests share."""

from __future__ import annotations

import logging
import sys

import pytest

from probe.__main__ import main
from probe.testing.compose import QUIET
from probe.testing.models import assert_no_hooks, built_models


@pytest.fixture
def cli_here(tmp_path, capfd, monkeypatch):
    """Run the console entry point in-process; returns (exit code, everything it printed)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def call(*args: str, run_dir=None) -> tuple[int, str]:
        argv = ["probe", *QUIET, *args, f"hydra.run.dir={run_dir or tmp_path / 'run'}"]
        monkeypatch.setattr(sys, "argv", argv)
        # transformers' loggers keep handlers bound to earlier tests' captured streams, closed by
        # now: a warning of theirs would print a logging error's traceback (the cases check
        # probe's messages, never transformers' own)
        hf_logger = logging.getLogger("transformers")
        level = hf_logger.level
        hf_logger.setLevel(logging.CRITICAL)
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        finally:  # Hydra's handlers write to this test's captured streams: drop them
            hf_logger.setLevel(level)
            for handler in logging.root.handlers[:]:
                logging.root.removeHandler(handler)
                handler.close()
        out = capfd.readouterr()
        text = out.out + out.err
        assert "Traceback" not in text
        for model in built_models():
            assert_no_hooks(model)
        return code, text

    return call
