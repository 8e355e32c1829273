"""A model's config as the lifecycle loads it: the published config.pbtxt as override JSON, a client's override
merged in, and the instance count set."""

from __future__ import annotations

import json
import time
from typing import Any

from google.protobuf import json_format

from controlplane.lifecycle.overrides import apply_override
from controlplane.render import parse_config
from controlplane.store import PublishedModel

# A config parameter changed to rebuild every instance: an in-place instance change keeps the
# existing instances, a reload whose config differs replaces them all.
GENERATION_PARAMETER = "snooze_generation"


def rendered_config(config_text: str, *, where: str) -> dict[str, Any]:
    """A published config.pbtxt as the JSON a load override takes."""
    return json_format.MessageToDict(parse_config(config_text, where=where), preserving_proto_field_name=True)


def config_for(model: PublishedModel, override: dict[str, Any] | None) -> dict[str, Any]:
    """The model's config as it loads: the published config.pbtxt with a client's ``override``, if any, merged in
    (what the lifecycle loads, and what the activator answers for a sleeping model)."""
    return apply_override(rendered_config(model.config_text, where=f"model '{model.id}'"), override, model.id)


def config_with_instances(config: dict[str, Any], instances: int, *, replace: bool = False) -> dict[str, Any]:
    """``config`` (override JSON) with ``instances`` in its (first, and for snoozeml only) instance group.

    ``replace`` also changes a parameter, which makes Triton build every instance anew instead of
    updating the instance count in place.
    """
    config = json.loads(json.dumps(config))
    groups = config.setdefault("instance_group", [])
    if not groups:
        groups.append({"kind": "KIND_CPU"})
    groups[0]["count"] = instances
    if replace:
        # a token, not a time the lifecycle measures: the machine's nanoseconds differ on every call and across
        # restarts (a virtual clock's would repeat within one instant, and Triton would keep the instances)
        config.setdefault("parameters", {})[GENERATION_PARAMETER] = {"string_value": str(time.time_ns())}
    return config
