"""A client's config override on a repository load (Triton's ``parameters: {"config": "<ModelConfig JSON>"}``).

Triton replaces the model's whole config with the override. A snoozeml package's config carries what its
runtime needs, so here the override's top-level fields replace the package's rendered ones (``parameters``
merges by key), and a field snoozeml owns is refused, naming it, unless its value is the package's own. The
result is validated like a rendered config before any load (``controlplane.render.parse_config``).
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from controlplane.errors import InvalidPackageError, SnoozeError
from controlplane.render import PUBLISH_PARAMETER, parse_config

# Fields the package and its runtime decide: the model's identity and files, its tensors (the runtime's
# signature), its instances (the deployment and the autoscaler), its versions and its stream/state handling.
OWNED_FIELDS = (
    "name", "platform", "backend", "runtime", "default_model_filename", "cc_model_filenames", "input", "output",
    "batch_input", "batch_output", "instance_group", "version_policy", "model_transaction_policy",
    "sequence_batching", "ensemble_scheduling", "model_repository_agents",
)  # fmt: skip
# Set on a config that carries a client's override: the python runtime then takes its batch limit from Triton's
# config (``python_backend/triton_model.py``) instead of the package's rendering.
OVERRIDE_PARAMETER = "snooze_config_override"
# Parameters snoozeml sets: on loads that rebuild every instance (``configs.GENERATION_PARAMETER``), the above, and
# each publish's token (``render.PUBLISH_PARAMETER``).
RESERVED_PARAMETERS = ("snooze_generation", OVERRIDE_PARAMETER, PUBLISH_PARAMETER)
# ``LifecycleManager.load``'s default: a load that leaves the override as it is (not a repository load).
KEEP_OVERRIDE = object()
OVERRIDE_HINT = "send only the fields to change, e.g. '{\"max_batch_size\": 16}'"


class MalformedOverrideError(SnoozeError):
    """An override that is not a ModelConfig in JSON (Triton: it cannot read the model from its repository)."""

    status_code = 500
    code = "bad_config_override"


class ForbiddenOverrideError(SnoozeError):
    """An override that changes a field snoozeml owns."""

    status_code = 400
    code = "forbidden_config_override"


def parse_override(text: str, model_id: str) -> dict[str, Any]:
    """The override as ModelConfig JSON (top-level fields, proto field names); raise MalformedOverrideError."""
    try:
        raw = json.loads(text)
    except (TypeError, ValueError) as e:
        raise MalformedOverrideError(
            f"the config override for model '{model_id}' is not JSON: {e}", hint=OVERRIDE_HINT
        ) from None
    if not isinstance(raw, dict):
        raise MalformedOverrideError(
            f"the config override for model '{model_id}' must be a JSON object (a ModelConfig), "
            f"got {type(raw).__name__}",
            hint=OVERRIDE_HINT,
        )
    try:
        message = json_format.ParseDict(raw, model_config_pb2.ModelConfig())
    except json_format.ParseError as e:
        raise MalformedOverrideError(
            f"the config override for model '{model_id}' is not a Triton ModelConfig: {e}", hint=OVERRIDE_HINT
        ) from None
    as_dict = json_format.MessageToDict(message, preserving_proto_field_name=True)
    # a field set to its default (max_batch_size 0, an empty list) is still the client's choice
    return {_proto_name(key): as_dict.get(_proto_name(key), _default(message, _proto_name(key))) for key in raw}


def _proto_name(key: str) -> str:
    fields = model_config_pb2.ModelConfig.DESCRIPTOR.fields
    return next((f.name for f in fields if key in (f.name, f.json_name)), key)


def _default(message: model_config_pb2.ModelConfig, name: str) -> Any:
    """The JSON of a field the client set to its default (which MessageToDict leaves out)."""
    value = getattr(message, name)
    if hasattr(value, "keys"):  # a map
        return {}
    if hasattr(value, "extend"):  # a repeated field
        return []
    if hasattr(value, "DESCRIPTOR"):  # a message
        return json_format.MessageToDict(value, preserving_proto_field_name=True)
    enum = model_config_pb2.ModelConfig.DESCRIPTOR.fields_by_name[name].enum_type
    return enum.values_by_number[value].name if enum is not None else value


def _same(name: str, a: Any, b: Any) -> bool:
    """Two values of one ModelConfig field are equal as Triton reads them."""
    left = json_format.ParseDict({name: a} if a is not None else {}, model_config_pb2.ModelConfig())
    right = json_format.ParseDict({name: b} if b is not None else {}, model_config_pb2.ModelConfig())
    return bool(left == right)


def apply_override(rendered: dict[str, Any], override: dict[str, Any] | None, model_id: str) -> dict[str, Any]:
    """The package's rendered config (override JSON) with the client's ``override`` merged in, validated."""
    if not override:
        return rendered
    merged: dict[str, Any] = json.loads(json.dumps(rendered))
    for name, value in override.items():
        if name in OWNED_FIELDS and not _same(name, value, rendered.get(name)):
            raise ForbiddenOverrideError(
                f"the config override for model '{model_id}' changes '{name}', which snoozeml sets from the "
                "model's package and deployment",
                hint=f"leave '{name}' out of the override; publish a new deployment (snoozectl publish) to change it",
            )
        if name == "parameters":
            merged["parameters"] = _merged_parameters(rendered.get("parameters") or {}, value, model_id)
        else:
            merged[name] = value
    batched, was = int(merged.get("max_batch_size") or 0) > 0, int(rendered.get("max_batch_size") or 0) > 0
    if batched != was:
        raise ForbiddenOverrideError(
            f"the config override for model '{model_id}' sets max_batch_size {merged.get('max_batch_size', 0)}: "
            f"the package's tensors are {'batched' if was else 'not batched'} (max_batch_size "
            f"{rendered.get('max_batch_size', 0)}), and the override cannot add or remove the batch axis",
            hint="keep max_batch_size above 0 for a batched model (0 for one without a batch axis)",
        )
    merged.setdefault("parameters", {})[OVERRIDE_PARAMETER] = {"string_value": "client"}
    where = f"model '{model_id}' (config with the client's override)"
    try:
        message = json_format.ParseDict(merged, model_config_pb2.ModelConfig())
        parse_config(text_format.MessageToString(message), where=where)
    except json_format.ParseError as e:
        raise MalformedOverrideError(f"{where}: not a valid Triton ModelConfig: {e}", hint=OVERRIDE_HINT) from None
    except InvalidPackageError as e:
        raise ForbiddenOverrideError(e.message, hint=OVERRIDE_HINT) from None
    return merged


def _merged_parameters(published: dict[str, Any], given: dict[str, Any], model_id: str) -> dict[str, Any]:
    for key, value in given.items():
        if key in RESERVED_PARAMETERS or (key in published and published[key] != value):
            raise ForbiddenOverrideError(
                f"the config override for model '{model_id}' changes parameters['{key}'], which snoozeml sets",
                hint=f"leave parameters['{key}'] out of the override",
            )
    return {**published, **given}
