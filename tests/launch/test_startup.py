"""What `python -m probe` does before its first batch: it imports what the run uses and nothing
else (checked in the `-X importtime` record of a real run), composes and parses the config once,
and holds Python's collections while it starts (probe.launch.collector)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

import pytest

from probe.launch import collector
from probe.testing.compose import QUIET
from tests.helpers import ROOT

TINY = ["dataset.image_size=32", "dataset.num_samples=2", "dataset.batch_size=2", *QUIET]
# never imported by an image run (the report, the analyses, other models' libraries)
NEVER = ("transformers", "timm", "accelerate", "matplotlib", "xarray", "sklearn", "tokenizers")
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+\d+ \|( *)(\S+)")


def imports_of(tmp_path, *args: str) -> dict[str, list[str]]:
    """{module: the modules whose import imported it first, outermost first} of a run of
    `python -X importtime -m probe ARGS` (which must succeed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "probe", *TINY, *args,
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [(len(m[1]), m[2]) for m in map(IMPORT_LINE.match, done.stderr.splitlines()) if m]
    # a module's line follows the lines of what its import imported: walk back to find importers
    chains: dict[str, list[str]] = {}
    open_lines: list[tuple[int, str]] = []
    for indent, name in reversed(lines):
        while open_lines and open_lines[-1][0] >= indent:
            open_lines.pop()
        chains[name] = [n for _, n in open_lines]
        open_lines.append((indent, name))
    return chains


def imported_through(chains: dict[str, list[str]], module: str, importer: str) -> bool:
    """Whether `module` was first imported while `importer` (a module or a package) was."""
    return any(c == importer or c.startswith(importer + ".") for c in chains[module])


def test_the_default_image_run_imports_what_it_uses(tmp_path):
    """resnet18 over synthetic images: no transformers, report or analysis library; torch._dynamo
    only because torchvision imports it (its detection ops ask whether torch.compile is
    supported: a plain script importing torchvision pays it too); numba only for the statistics
    (where its kernels are compiled), and scipy and llvmlite only because numba imports them."""
    chains = imports_of(tmp_path, "model=resnet18")
    assert [m for m in chains if m.split(".")[0] in NEVER] == []
    assert imported_through(chains, "torch._dynamo", "torchvision")
    if "numba" in chains:
        assert imported_through(chains, "numba", "probe.stats.numba_backend")
    for module in ("scipy", "llvmlite"):
        assert module not in chains or imported_through(chains, module, "numba")


def test_a_run_of_another_model_imports_no_torchvision(tmp_path):
    """A model of its own (and the torch statistics): no torchvision, so no torch._dynamo and
    its sympy; no numba, scipy or pandas' plotting."""
    chains = imports_of(tmp_path, "model=lenet", "stats.backend=torch")
    absent = ("torchvision", "torch._dynamo", "sympy", "numba", "scipy", "llvmlite", *NEVER)
    assert [m for m in chains if m.startswith(absent)] == []


def test_a_run_composes_and_parses_its_config_once(cli_here, monkeypatch):
    """Hydra's own first compose (only to read hydra.mode, which probe's config leaves unset)
    is skipped; probe.plan.parse runs once."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    import probe.__main__
    import probe.launch.run

    calls = {"compose": 0, "parse": 0}
    compose, parse = ConfigLoaderImpl.load_configuration, probe.__main__.parse

    def counted_compose(self, *args, **kwargs):
        calls["compose"] += 1
        return compose(self, *args, **kwargs)

    def counted_parse(*args, **kwargs):
        calls["parse"] += 1
        return parse(*args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted_compose)
    monkeypatch.setattr(probe.__main__, "parse", counted_parse)
    monkeypatch.setattr(probe.launch.run, "parse", counted_parse)
    code, text = cli_here("model=lenet", "stats.backend=torch", "dataset.num_samples=2")
    assert code == 0, text
    assert calls == {"compose": 1, "parse": 1}


@pytest.mark.parametrize(
    "args", [["hydra.mode=RUN"], ["--config-name", "config"], ["hydra/launcher=basic"]]
)
def test_hydra_composes_as_it_does_where_the_mode_may_be_set(args):
    """Where the command line may set hydra.mode (or take the config from elsewhere), Hydra's
    own first compose stays."""
    from hydra._internal.hydra import Hydra

    from probe.__main__ import _compose_once

    get_mode = Hydra.get_mode
    with _compose_once(args):
        assert Hydra.get_mode is get_mode
    with _compose_once(["model=lenet", "-m", "seed=1,2"]):
        assert Hydra.get_mode is not get_mode
    assert Hydra.get_mode is get_mode


def test_a_config_file_that_sets_the_mode_keeps_hydras_first_compose(tmp_path, monkeypatch):
    """A file in the config folder that sets hydra.mode (a sweep kept in an experiment file,
    as Hydra's docs show) keeps Hydra's own first compose: -m is then not needed to sweep."""
    from hydra._internal.hydra import Hydra

    import probe.__main__ as cli

    (tmp_path / "experiment").mkdir()
    (tmp_path / "store.yaml").write_text("mode: stats\n")  # (a key of probe's own: no alarm)
    assert not cli._files_may_set_mode(tmp_path)
    (tmp_path / "experiment" / "sweep.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      seed: 1,2\n"
    )
    assert cli._files_may_set_mode(tmp_path)
    monkeypatch.setattr(cli, "config_dir", lambda: str(tmp_path))
    get_mode = Hydra.get_mode
    with cli._compose_once(["+experiment=sweep"]):
        assert Hydra.get_mode is get_mode


def test_torchvision_version_without_importing_it(monkeypatch):
    """The file's torchvision_version, read from torchvision's version.py where no run imported
    torchvision, is torchvision.__version__."""
    import torchvision

    from probe.models.build import torchvision_version

    monkeypatch.delitem(sys.modules, "torchvision")
    assert torchvision_version() == torchvision.__version__
    assert "torchvision" not in sys.modules
    monkeypatch.setitem(sys.modules, "torchvision", torchvision)
    assert torchvision_version() == torchvision.__version__


def test_the_collector_is_held_only_where_the_command_line_holds_it(monkeypatch):
    """`release` (every run's loop start) does nothing in a caller's process; after `hold`
    it freezes what is alive and collects again, and the exit freezes."""
    exits = []
    monkeypatch.setattr(collector.atexit, "register", exits.append)
    frozen = gc.get_freeze_count()
    collector.release()
    assert gc.isenabled() and gc.get_freeze_count() == frozen and exits == []
    try:
        collector.hold()
        assert not gc.isenabled() and exits == [gc.freeze]
        collector.release()
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        collector.release()  # (once)
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
        collector._held = False
