"""Where a transcoder set's YAML says its files are: a HuggingFace file URI (hf://, downloaded
on demand), an absolute path, or a path in the YAML's folder (per-layer and cross-layer sets
alike)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

from probe.errors import ConfigError


def parse_hf_uri(uri: str) -> tuple[str, str, str | None]:
    """(repo id, file path in the repo, revision or None) of `hf://org/repo/path?revision=x`."""
    parsed = urlparse(uri)
    repo, _, file_path = parsed.path.lstrip("/").partition("/")
    if parsed.scheme != "hf" or not parsed.netloc or not repo or not file_path:
        raise ConfigError(
            f"{uri!r} is not a HuggingFace file URI: write hf://ORG/REPO/PATH/IN/REPO"
            "[?revision=REV], as circuit-tracer's configs do"
        )
    revision = parse_qs(parsed.query).get("revision", [None])[0] or None
    return f"{parsed.netloc}/{repo}", file_path, revision


def local_file(filepath: str, folder: Path) -> Path:
    """The file a YAML's `filepath` names: downloaded (hf://), absolute, or in the YAML's folder."""
    if filepath.startswith("hf://"):
        repo_id, file_path, revision = parse_hf_uri(filepath)
        from huggingface_hub import hf_hub_download  # (only an hf:// set needs it)

        return Path(hf_hub_download(repo_id=repo_id, filename=file_path, revision=revision))
    path = Path(filepath).expanduser()
    return path if path.is_absolute() else folder / path
