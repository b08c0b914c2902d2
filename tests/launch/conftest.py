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
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        finally:  # Hydra's handlers write to this test's captured streams: drop them
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
