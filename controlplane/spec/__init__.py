"""What users write: model packages, their manifest, and deployment settings (models.toml).

A *package* is a folder with ``snooze_model.py`` (custom), ``model.onnx`` or ``model.plan``, plus an
optional ``snooze_model.json`` manifest. A *deployment* says how one package is served (id, device,
batching, idle timeout, instances). ``ModelSpec`` joins the two and is what the renderer consumes.

Three jobs, one module each: ``schema`` (the pydantic models), ``loading`` (a package folder read and
checked, joined with its deployment) and ``discovery`` (models.toml, a models folder, entry points).
Callers import from ``controlplane.spec``. Nothing here imports user code.
"""

from controlplane.source_inspect import predict_is_generator
from controlplane.spec.discovery import (
    discover,
    entry_point_deployments,
    is_package_dir,
    load_models_toml,
)
from controlplane.spec.loading import (
    load_package,
    package_files,
    package_kind,
    read_manifest,
    resolve,
    resolve_all,
    validate_params,
)
from controlplane.spec.schema import (
    CUSTOM_ENTRYPOINT,
    ENTRY_POINT_GROUP,
    MANIFEST_FILE,
    MODEL_ID_PATTERN,
    MODULE_NAME_PATTERN,
    DeploymentSpec,
    Device,
    Manifest,
    ModelPackage,
    ModelSpec,
    PackageKind,
    ParamSpec,
    SequenceSpec,
    TensorSpec,
    is_decoupled,
    python_specifier,
)
from converters.files import ONNX_FILE, PLAN_FILE

__all__ = [
    "CUSTOM_ENTRYPOINT",
    "ENTRY_POINT_GROUP",
    "MANIFEST_FILE",
    "MODEL_ID_PATTERN",
    "MODULE_NAME_PATTERN",
    "ONNX_FILE",
    "PLAN_FILE",
    "DeploymentSpec",
    "Device",
    "Manifest",
    "ModelPackage",
    "ModelSpec",
    "PackageKind",
    "ParamSpec",
    "SequenceSpec",
    "TensorSpec",
    "discover",
    "entry_point_deployments",
    "is_decoupled",
    "is_package_dir",
    "load_models_toml",
    "load_package",
    "package_files",
    "package_kind",
    "predict_is_generator",
    "python_specifier",
    "read_manifest",
    "resolve",
    "resolve_all",
    "validate_params",
]
