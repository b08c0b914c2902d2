"""`python -m probe` / `probe`: compose the config with Hydra, run, turn user errors into messages.

torch is imported only once probe.plan has parsed the config (every check the config alone decides),
so a config mistake is reported in about a second. The config is composed once (`_compose_once`)
and parsed once (`probe.plan.parse`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from probe.config import config_dir
from probe.errors import ProbeError
from probe.launch import collector
from probe.launch.interrupt import Interrupted
from probe.launch.sweep import JobFailed, in_sweep, job_label
from probe.plan import parse
from probe.store import runlock

log = logging.getLogger("probe")
# run directories that existed before this process (set by main): never removed on an error
_EXISTING: set[Path] | None = None


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def app(cfg: DictConfig) -> None:
    try:
        plan = parse(cfg)
        for message in plan.unread:
            log.warning("%s", message)
        from probe.launch.run import run

        run(plan)
    except Interrupted as e:
        log.warning("%s", e)
        print(f"probe: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (ProbeError, OmegaConfBaseException) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        message = str(e) if isinstance(e, ProbeError) else _config_message(e)
        log.error("%s", message)
        if getattr(e, "hdf5_unclosed", False):  # a file HDF5 could not close crashes it at exit
            print(f"probe: error: {message}", file=sys.stderr)
            logging.shutdown()
            sys.stderr.flush()
            os._exit(2)
        if in_sweep():
            # Hydra's sweepers finish every job of the batch before they look at the failures,
            # then print this message (a compact error: no traceback) and exit non-zero.
            raise JobFailed(f"probe: error in job {job_label()}: {message}") from None
        _remove_empty_run_dir()
        print(f"probe: error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(
            "probe: interrupted; probe.h5 holds every batch written before (its `complete` "
            "says whether the run had finished); continue with resume=true",
            file=sys.stderr,
        )
        sys.exit(130)


def _config_message(e: OmegaConfBaseException) -> str:
    """OmegaConf's message without its internal details, plus the way out."""
    first = str(e).splitlines()[0]
    key = getattr(e, "full_key", None)
    if isinstance(e, MissingMandatoryValue):
        return f"{first}: give it on the command line, e.g. {key}=VALUE"
    return f"{first} (key {key})" if key else first


def _remove_empty_run_dir() -> None:
    """Remove the run directory Hydra made for this run if it holds only Hydra's own files (.hydra/
    and the log): a run stopped by an error before writing anything leaves no empty folder."""
    from hydra.core.hydra_config import HydraConfig

    if _EXISTING is None or not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir).absolute()
    if run_dir in _EXISTING or run_dir == Path.cwd() or not run_dir.is_dir():
        return
    log_file = run_dir / f"{hc.job.name}.log"
    meta = run_dir / hc.output_subdir if hc.output_subdir else log_file
    bookkeeping = {"config.yaml", "hydra.yaml", "overrides.yaml"}
    lock = runlock.lock_name()
    if {p.name for p in run_dir.iterdir()} - {log_file.name, meta.name, lock} or (
        meta.is_dir() and {p.name for p in meta.iterdir()} - bookkeeping
    ):
        return
    runlock.release(run_dir)  # removes its lock file
    for handler in logging.root.handlers[:]:  # its log file is about to go
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log_file:
            logging.root.removeHandler(handler)
            handler.close()
    try:
        if meta.is_dir():
            for name in bookkeeping:
                (meta / name).unlink(missing_ok=True)
            meta.rmdir()
        log_file.unlink(missing_ok=True)
        run_dir.rmdir()
        if not _run_dir_given(sys.argv[1:]):  # the default outputs/<date>/<time>: the empty
            cwd = Path.cwd()  # folders above it too, up to the working directory
            for parent in run_dir.parents:
                if cwd not in parent.parents:
                    break
                parent.rmdir()
    except OSError:  # something else appeared meanwhile: keep it
        pass


def _run_dir_given(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]


def _unwritable_output(argv: list[str]) -> str | None:
    """The run/sweep directory the command line asks for, if no ancestor of it can be written.

    Hydra creates that directory before the job starts, so this is checked first to give a message
    instead of Hydra's traceback.
    """
    wanted = [
        a.split("=", 1)[1] for a in argv if a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))
    ]
    for raw in wanted or ["outputs"]:
        path = Path(raw).expanduser().absolute()
        probe_dir = path
        while not probe_dir.exists() and probe_dir != probe_dir.parent:
            probe_dir = probe_dir.parent
        if not probe_dir.is_dir() or not os.access(probe_dir, os.W_OK | os.X_OK):
            return str(path)
    return None


def _is_group(arg: str) -> bool:
    """Whether `arg` sets a config group (model=, probes=, ...), not a key inside one."""
    name = arg.split("=", 1)[0].lstrip("+~")
    return "." not in name and (Path(config_dir()) / name).is_dir()


# overrides that may set hydra.mode or change where the primary config comes from
_MODE_KEYS = ("hydra.mode", "hydra.searchpath", "hydra/")


@contextlib.contextmanager
def _compose_once(argv: list[str]):
    """Hydra composes a run's config twice: first only to read `hydra.mode` (`Hydra.get_mode`,
    which answers None on any error, so its compose reports nothing), then for the job. Where
    no file of probe's config folder sets hydra.mode (`_files_may_set_mode`: the shipped ones
    do not; a file a user added there might), no search-path plugin adds other folders, and
    the command line neither sets it nor changes where the config comes from (--config-name,
    --config-path, --config-dir, a hydra/ group, hydra.searchpath), that first compose can only
    answer None: it is skipped (a quarter of a second of every start). Elsewhere, or should
    Hydra change, Hydra runs as it is."""
    try:
        from hydra._internal.hydra import Hydra
    except ImportError:
        yield
        return
    flags = [a for a in argv if a.startswith("-")]
    keys = [a.split("=", 1)[0].lstrip("+~") for a in argv if not a.startswith("-")]
    elsewhere = any(f.startswith(("--config", "-cn", "-cp", "-cd")) for f in flags)
    if (
        elsewhere
        or any(k.startswith(_MODE_KEYS) for k in keys)
        or not hasattr(Hydra, "get_mode")
        or _other_search_paths()
        or _files_may_set_mode(Path(config_dir()))
    ):
        yield
        return
    get_mode = Hydra.get_mode
    Hydra.get_mode = _mode_unset  # type: ignore[method-assign]  # (for this process's run)
    try:
        yield
    finally:
        Hydra.get_mode = get_mode  # type: ignore[method-assign]


_INDENTED_MODE = re.compile(r"^\s+mode\s*:", re.MULTILINE)


def _files_may_set_mode(folder: Path) -> bool:
    """Whether a config file under `folder` may set hydra.mode (a `hydra:` block with an indented
    `mode:` key; a false alarm only costs the compose that is otherwise skipped)."""
    for path in folder.rglob("*.yaml"):
        text = path.read_text(errors="replace")
        if "hydra" in text and _INDENTED_MODE.search(text):
            return True
    return False


def _other_search_paths() -> bool:
    """Whether an installed Hydra plugin adds config folders (their files are not looked at)."""
    try:
        from hydra.core.plugins import Plugins
        from hydra.plugins.search_path_plugin import SearchPathPlugin

        return bool(Plugins.instance().discover(SearchPathPlugin))
    except Exception:  # (a Hydra without them: assume there may be some)
        return True


def _mode_unset(self, config_name: str | None, overrides: list[str]) -> None:
    """What Hydra.get_mode answers for probe's config when the command line sets no hydra.mode."""
    return None


def main() -> None:
    global _EXISTING
    # a given run directory that exists (or whose name Hydra resolves: it may) is kept
    _EXISTING = {
        Path(d).expanduser().absolute()
        for d in _run_dir_given(sys.argv[1:])
        if "${" not in d and Path(d).expanduser().exists()
    }
    if any("${" in d for d in _run_dir_given(sys.argv[1:])):
        _EXISTING = None
    nulled = [a for a in sys.argv[1:] if a.split("=", 1)[-1] in ("null", "{}") and _is_group(a)]
    if nulled:
        group = nulled[0].split("=", 1)[0].lstrip("+~")
        hint = ", e.g. probes=none for no probes" if group == "probes" else ""
        print(
            f"probe: error: {nulled[0]} names no option of the config group {group!r}; choose one "
            f"(python -m probe --help lists them){hint}",
            file=sys.stderr,
        )
        sys.exit(2)
    bad = _unwritable_output(sys.argv[1:])
    if bad is not None:
        print(
            f"probe: error: the run directory {bad!r} cannot be created (no writable directory above it); "
            "choose a writable one with hydra.run.dir=PATH (hydra.sweep.dir=PATH for -m)",
            file=sys.stderr,
        )
        sys.exit(2)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun (imports torch)
        from probe.launch import distributed

        if {"-m", "--multirun"} & set(sys.argv):
            print(
                "probe: error: torchrun runs one job; sweep over torchrun jobs with a launcher "
                "instead",
                file=sys.stderr,
            )
            sys.exit(2)
        sys.argv[1:] = distributed.agree_run_dir(sys.argv[1:])
    try:
        with _compose_once(sys.argv[1:]):
            app()
    finally:  # the run directory's lock, taken before Hydra wrote into it (probe.store.runlock)
        runlock.release_cli()


def cli() -> None:
    """The `probe` command and `python -m probe`: `main` in a process of its own, which holds
    Python's garbage collections while it starts (probe.launch.collector; not for a sweep, whose
    jobs share the process)."""
    argv = sys.argv[1:]
    keys = [a.split("=", 1)[0].lstrip("+~") for a in argv if not a.startswith("-")]
    if not {"-m", "--multirun"} & set(argv) and not any(k.startswith(_MODE_KEYS) for k in keys):
        collector.hold()
    main()


if __name__ == "__main__":
    cli()
