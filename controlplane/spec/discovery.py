"""Finding packages: models.toml, a models folder (a Triton repository too), and installed distributions' entry
points."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import ValidationError

from controlplane.errors import InvalidPackageError
from controlplane.spec.schema import (
    CUSTOM_ENTRYPOINT,
    ENTRY_POINT_GROUP,
    MANIFEST_FILE,
    DeploymentSpec,
    format_validation_error,
)
from controlplane.spec.triton_folder import looks_like_triton_folder
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


def is_package_dir(path: Path) -> bool:
    """A folder that is a package itself: a snoozeml package (snooze_model.py, model.onnx, model.plan, a manifest's
    entrypoint) or a Triton model folder (config.pbtxt and/or numbered version folders with a model file)."""
    if not path.is_dir():
        return False
    if any((path / name).is_file() for name in (CUSTOM_ENTRYPOINT, ONNX_FILE, PLAN_FILE, MANIFEST_FILE)):
        return True
    return looks_like_triton_folder(path)


# Folders of a models folder that are never models: tools' caches and version control.
_NOT_MODELS = {"__pycache__", ".git", ".ipynb_checkpoints"}


def discover(models_dir: str | Path) -> list[DeploymentSpec]:
    """Deployments for a models folder: its models.toml entries plus every other sub-folder (id = folder name), a
    Triton repository's model folders included. A sub-folder that is no package is listed too: resolving it
    refuses it with the reason (nothing is skipped silently), unless models.toml names packages inside it (a
    ``pkgs/`` folder of the packages it lists: those are its deployments). A models folder that is a package itself
    (a single Triton model folder, say) is its one deployment. A ``.toml`` file given instead of a folder: its
    entries alone."""
    root = Path(models_dir)
    if root.is_file() and root.suffix == ".toml":
        return _check_unique_ids(load_models_toml(root), str(root))
    if not root.is_dir():
        raise InvalidPackageError(
            f"{root}: models folder not found",
            hint="pass a folder of packages (and/or a models.toml), or a models.toml file",
        )
    toml_path = root / "models.toml"
    if not toml_path.exists() and is_package_dir(root):
        return [_folder_deployment(root.resolve())]
    specs = load_models_toml(toml_path) if toml_path.exists() else []
    named_paths = {s.path.resolve() for s in specs}
    named_ids = {s.id for s in specs}
    resolved_root = root.resolve()
    # the sub-folders that hold packages models.toml names deeper down (a few parents each)
    holders = {parent for named in named_paths for parent in named.parents}
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.name.startswith(".") or child.name in _NOT_MODELS:
            continue
        # one realpath for the folder, not one per package (10,000 packages: a second): a link is resolved itself
        path = child.resolve() if child.is_symlink() else resolved_root / child.name
        if path in named_paths or child.name in named_ids or (path in holders and not is_package_dir(path)):
            continue
        specs.append(_folder_deployment(path))
    return _check_unique_ids(specs, str(root))


def _folder_deployment(folder: Path) -> DeploymentSpec:
    try:
        return DeploymentSpec(id=folder.name, path=folder)
    except ValidationError as exc:
        raise InvalidPackageError(
            format_validation_error(exc, f"{folder}"),
            hint="rename the folder (letters, digits, '_', '.', '-') or list it in models.toml",
        ) from exc


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
