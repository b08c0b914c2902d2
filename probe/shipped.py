"""The config files shipped in conf/, by name: composed as the command line composes them, for
the Python API (`probe.run(..., probes="all_convs")`) and `probe.sites(model, probes=NAME)`."""

from __future__ import annotations

from pathlib import Path

from probe.config import config_dir


def check_shipped(group: str, name: str) -> None:
    """A ConfigError listing the choices unless `name` is a file of config group `group`."""
    from probe.errors import ConfigError

    shipped = sorted(p.stem for p in (Path(config_dir()) / group).glob("*.yaml"))
    if name not in shipped:
        raise ConfigError(
            f"{group}={name!r} is not a shipped {group} file; choose from {', '.join(shipped)}, "
            "or give a mapping of its keys"
        )


def shipped_probes(name: str):
    """The probes of shipped probe file `name`, composed (and typed) as the CLI composes them."""
    check_shipped("probes", name)
    return compose_shipped([f"probes={name}"]).probes


def compose_shipped(overrides: list[str]):
    """compose("config", overrides) of the shipped config directory; a name that is not a shipped
    file is a ConfigError listing the choices."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from probe.errors import ConfigError

    if GlobalHydra.instance().is_initialized():
        raise ConfigError(
            "probe.run composes its config with Hydra, which is already initialised in this "
            "process (inside a @hydra.main app); call probe.launch.run.run(cfg, ...) with that config"
        )
    try:
        with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
            return compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        text = f"{e}\n{e.__cause__ or ''}"  # Hydra's "Error merging override" holds the reason
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        said = [line for line in lines if not line.startswith(("object_type=", "reference_type="))]
        raise ConfigError("; ".join(said)) from None  # what failed, why, and the key
