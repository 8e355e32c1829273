"""Finding packages: models.toml, a models folder, and installed distributions' entry points."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import ValidationError

from controlplane.errors import InvalidPackageError
from controlplane.spec.schema import (
    CUSTOM_ENTRYPOINT,
    ENTRY_POINT_GROUP,
    DeploymentSpec,
    format_validation_error,
)
from converters.files import ONNX_FILE, PLAN_FILE


def load_models_toml(path: str | Path) -> list[DeploymentSpec]:
    toml_path = Path(path)
    try:
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InvalidPackageError(f"{toml_path}: file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidPackageError(f"{toml_path}: not valid TOML ({exc})") from exc
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise InvalidPackageError(
            f"{toml_path}: unknown top-level key(s) {unknown}", hint="models.toml holds [[models]] tables only"
        )
    entries = data.get("models", [])
    if not isinstance(entries, list):
        raise InvalidPackageError(f"{toml_path}: 'models' must be an array of tables ([[models]])")
    specs = []
    for i, entry in enumerate(entries):
        where = f"{toml_path} [[models]] #{i + 1}" + (f" (id '{entry.get('id')}')" if "id" in entry else "")
        try:
            spec = DeploymentSpec.model_validate(entry)
        except ValidationError as exc:
            raise InvalidPackageError(format_validation_error(exc, where)) from exc
        if not spec.path.is_absolute():
            spec = spec.model_copy(update={"path": (toml_path.parent / spec.path).resolve()})
        specs.append(spec)
    return _check_unique_ids(specs, str(toml_path))


def _check_unique_ids(specs: list[DeploymentSpec], where: str) -> list[DeploymentSpec]:
    seen: dict[str, Path] = {}
    for spec in specs:
        if spec.id in seen:
            raise InvalidPackageError(
                f"{where}: model id '{spec.id}' is used twice ({seen[spec.id]} and {spec.path})",
                hint="give each model its own id",
            )
        seen[spec.id] = spec.path
    return specs


def is_package_dir(path: Path, *, discoverable_only: bool = False) -> bool:
    """A folder holding a model file; discovery looks only for snooze_model.py and model.onnx."""
    names = (CUSTOM_ENTRYPOINT, ONNX_FILE) if discoverable_only else (CUSTOM_ENTRYPOINT, ONNX_FILE, PLAN_FILE)
    return path.is_dir() and any((path / name).is_file() for name in names)


def discover(models_dir: str | Path) -> list[DeploymentSpec]:
    """Deployments for a models folder: its models.toml entries plus every sub-folder holding
    snooze_model.py or model.onnx that models.toml does not already name (id = folder name)."""
    root = Path(models_dir)
    if not root.is_dir():
        raise InvalidPackageError(f"{root}: models folder not found")
    toml_path = root / "models.toml"
    specs = load_models_toml(toml_path) if toml_path.exists() else []
    named_paths = {s.path.resolve() for s in specs}
    named_ids = {s.id for s in specs}
    resolved_root = root.resolve()
    for child in sorted(root.iterdir()):
        # one realpath for the folder, not one per package (10,000 packages: a second): a link is resolved itself
        path = child.resolve() if child.is_symlink() else resolved_root / child.name
        named = path in named_paths or child.name in named_ids
        if is_package_dir(child, discoverable_only=True) and not named:
            try:
                specs.append(DeploymentSpec(id=child.name, path=path))
            except ValidationError as exc:
                raise InvalidPackageError(
                    format_validation_error(exc, f"{child}"),
                    hint="rename the folder (letters, digits, '_', '.', '-') or list it in models.toml",
                ) from exc
    return _check_unique_ids(specs, str(root))


def entry_point_deployments() -> list[DeploymentSpec]:
    """Packages exposed by installed distributions in the ``snoozeml.models`` entry-point group.

    The entry point names the model id; its object is a package path, a module (its folder is the
    package) or a callable returning either."""
    from importlib.metadata import entry_points

    specs = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                obj = obj()
            path = Path(obj.__file__).parent if hasattr(obj, "__file__") else Path(obj)
        except Exception as exc:
            raise InvalidPackageError(
                f"entry point '{ep.name} = {ep.value}' in group {ENTRY_POINT_GROUP}: cannot be loaded ({exc})",
                hint="it must name a package folder path, a module inside the package, or a callable returning one",
            ) from exc
        specs.append(DeploymentSpec(id=ep.name, path=path))
    return specs
