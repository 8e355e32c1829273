"""What a snapshot was captured with, and what differs at restore: the configuration fingerprint.

The settings that change what is served (secrets as their sha256), the published models' config and
deployment record, and what the models folder renders to now; one digest over them all, and one line per
part that differs when a restored process compares its own fingerprint with the captured one."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from controlplane.errors import SnoozeError
from controlplane.render import DEPLOYMENT_FILE, render_model
from controlplane.settings import Settings
from controlplane.spec import discover, resolve
from controlplane.stack import ServingStack
from controlplane.store import PublishedModel

# Settings that do not change what is served or how it answers.
SETTINGS_NOT_FINGERPRINTED = frozenset({"log_level"})
FINGERPRINT_FORMAT = 1


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _settings_part(settings: Settings) -> dict[str, Any]:
    """Every setting that changes what is served; secrets as their sha256, never in clear."""
    part: dict[str, Any] = {}
    for name in sorted(type(settings).model_fields):
        if name in SETTINGS_NOT_FINGERPRINTED:
            continue
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = "sha256:" + _sha256(value.get_secret_value().encode())
        elif isinstance(value, list):
            value = [
                "sha256:" + _sha256(v.get_secret_value().encode()) if isinstance(v, SecretStr) else v for v in value
            ]
        elif isinstance(value, Path):
            value = str(value)
        part[name] = value
    return part


def _published_part(models: list[PublishedModel]) -> dict[str, Any]:
    return {
        m.id: {
            "config": _file_sha256(m.path / "config.pbtxt"),
            "deployment": _file_sha256(m.path / DEPLOYMENT_FILE),
        }
        for m in models
    }


def _sources_part(models_dir: Path | None, stack: ServingStack) -> dict[str, Any]:
    """What the models folder renders to now: a changed package or models.toml shows up here even
    though the running process does not publish it again."""
    if models_dir is None:
        return {}
    assert stack.store is not None
    part: dict[str, Any] = {}
    for deployment in discover(models_dir):
        try:
            rendered = render_model(resolve(deployment), stack.store.target)
        except SnoozeError as exc:
            part[deployment.id] = {"error": exc.message}
            continue
        files = hashlib.sha256()
        for rel, data in sorted({**rendered.writes, **rendered.shared}.items()):
            files.update(f"{rel}\0{_sha256(data)}\0".encode())
        for src, rel in sorted(rendered.copies, key=lambda c: c[1]):
            files.update(f"{rel}\0{_file_sha256(src)}\0".encode())
        part[deployment.id] = {
            "config": _sha256(rendered.writes["config.pbtxt"]),
            "deployment": _sha256(rendered.writes[DEPLOYMENT_FILE]),
            "files": files.hexdigest(),
        }
    return part


def compute_fingerprint(
    settings: Settings, stack: ServingStack, models_dir: Path | None, models_to_load: list[str] | None
) -> dict[str, Any]:
    """``{"format", "digest", "parts": {settings, models_to_load, published, sources}}``."""
    assert stack.store is not None
    parts = {
        "settings": _settings_part(settings),
        "models_to_load": sorted(models_to_load) if models_to_load else "all published",
        "published": _published_part(stack.store.list()),
        "sources": _sources_part(models_dir, stack),
    }
    digest = _sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    return {"format": FINGERPRINT_FORMAT, "digest": digest, "parts": parts}


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value
    return out


def fingerprint_differences(captured: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per differing entry, e.g. ``settings.http_port: 8000 at capture, 9000 now``."""
    if captured.get("format") != current.get("format"):
        return [f"fingerprint format {captured.get('format')} at capture, {current.get('format')} now"]
    if captured.get("digest") == current.get("digest"):
        return []
    old = _flatten(captured.get("parts", {}), "", {})
    new = _flatten(current.get("parts", {}), "", {})
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            lines.append(f"{key}: present at capture, gone now")
        elif key not in old:
            lines.append(f"{key}: new since the capture")
        elif old[key] != new[key]:
            if key.startswith(("published.", "sources.")) or "sha256:" in json.dumps(old[key]):
                lines.append(f"{key}: changed since the capture")
            else:
                lines.append(f"{key}: {json.dumps(old[key])} at capture, {json.dumps(new[key])} now")
    return lines
