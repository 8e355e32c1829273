"""Request and response bodies of the control API (they also make its OpenAPI document)."""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, create_model

from controlplane.lifecycle.state import ModelStatus
from controlplane.spec import TensorSpec


class ErrorBody(BaseModel):
    """The one error shape of snoozeml (``SnoozeError.to_dict()``)."""

    error: str = Field(description="What went wrong, naming the model, file or field")
    code: str = Field(description="Stable machine-readable code, e.g. invalid_package, not_found")
    hint: str | None = Field(None, description="How to fix it")


def _status_body() -> type[BaseModel]:
    """``ModelStatus``'s fields as a response body: the same names, types and descriptions (one definition,
    in ``lifecycle/state.py``). Extra keys are allowed: the fleet adds ``nodes``."""
    hints = typing.get_type_hints(ModelStatus)
    body: dict[str, Any] = {}
    for f in dataclasses.fields(ModelStatus):
        default = ... if f.default is dataclasses.MISSING else f.default
        body[f.name] = (hints[f.name], Field(default, description=f.metadata.get("description")))
    model = create_model("ModelStatusBody", __config__=ConfigDict(extra="allow"), **body)
    model.__doc__ = "A model's lifecycle state (``ModelStatus`` in docs/internals.md)."
    return model


if TYPE_CHECKING:
    # Built at run time from ModelStatus's fields: to a type checker it is a pydantic model.
    ModelStatusBody: TypeAlias = BaseModel
else:
    ModelStatusBody = _status_body()


class PreloadedParentBody(BaseModel):
    """One preloaded parent of preforked models (``controlplane/lifecycle/workers.py``)."""

    pid: int
    preload: list[str] = Field(description="Modules it imported (numpy always)")
    failed: dict[str, str] = Field(default_factory=dict, description="Modules it could not import, and why")
    python: str = Field(description="The interpreter it runs")
    import_secs: dict[str, float] = Field(default_factory=dict, description="Seconds each import took")
    warm_secs: dict[str, float] = Field(
        default_factory=dict, description="Seconds spent warming each module's kernels and thread pools before forking"
    )
    spare_imports: list[str] = Field(
        default_factory=list,
        description="Modules it never imports (their import starts threads no fork survives, e.g. onnxruntime): its "
        "spare worker, forked ahead of need, imports them and is handed the next model to load",
    )
    spare_pid: int | None = Field(None, description="The spare worker waiting now")
    memory_bytes: int | None = Field(
        None, description="Its own memory and its spare's (Pss: its share of the pages its workers share with it)"
    )
    unique_bytes: int | None = Field(None, description="USS: what would leave if it (and its spare) ended")
    workers: int = Field(0, description="Workers it forked that are still running (its spare apart)")


class WakeQueueEntry(BaseModel):
    model: str
    waiting_for: str = Field(
        description="'a load slot' (SNOOZE_MAX_CONCURRENT_LOADS) or 'memory' (held by loads and requests in flight)"
    )
    wait_secs: float = Field(description="How long its load has waited to start")


class WakeQueueBody(BaseModel):
    length: int = Field(0, description="Loads of sleeping models waiting to start")
    oldest_wait_secs: float = Field(0.0, description="How long the oldest of them has waited")
    wait_bound_secs: float = Field(
        description="SNOOZE_WAKE_QUEUE_TIMEOUT_SECS: a request whose model's load has "
        "not started by then is answered 503 with Retry-After"
    )
    waiting: list[WakeQueueEntry] = Field(default_factory=list, description="Oldest first")


class RuntimeBody(BaseModel):
    preloaded_parents: list[PreloadedParentBody]
    overhead_bytes: int = Field(0, description="Memory the budget counts beside the models' own (the parents')")
    triton_server_bytes: int = Field(
        0,
        description="tritonserver's own resident memory, which the memory budget counts beside the models' (last "
        "read at a sweep or a load; 0 where tritonserver's process cannot be seen: the budget is then for the "
        "models alone)",
    )
    accounted_bytes: int = Field(
        0, description="What the memory budget counts now: models, tritonserver and parents (proportional bytes)"
    )
    models_bytes: int = Field(0, description="The loaded models' share of it (their processes' Pss summed)")
    budget_bytes: int | None = Field(
        None, description="The host memory budget (SNOOZE_MEMORY_BUDGET_MB, else the cgroup ceiling); None: no limit"
    )
    cgroup_usage_bytes: int | None = Field(
        None,
        description="Triton's memory cgroup's working set (usage less inactive file pages); None where not readable",
    )
    cgroup_limit_bytes: int | None = Field(None, description="Its memory limit; None: no limit or not readable")
    cgroup_ceiling_bytes: int | None = Field(
        None, description="The limit less SNOOZE_MEMORY_HEADROOM_MB: over it, each sweep evicts idle models"
    )
    eviction_policy: dict[str, Any] = Field(
        default_factory=dict,
        description="SNOOZE_EVICTION_POLICY ('name': gdsf or lru) and its state (gdsf: its clock, aging window and "
        "halvings so far)",
    )
    wake_queue: WakeQueueBody | None = Field(None, description="Loads waiting to start")


class ModelSummary(BaseModel):
    id: str
    kind: str = Field(
        description="custom | onnx | tensorrt, or a Triton model folder: triton-python | triton-onnx | triton-plan | "
        "triton-ensemble"
    )
    backend: str = Field(description="Triton backend the model runs on: python | onnxruntime | tensorrt | ensemble")
    device: str
    max_batch_size: int
    status: ModelStatusBody
    notes: list[str] = Field(
        default_factory=list,
        description="What publishing decided for the model and why (e.g. max_batch_size 0 for a model whose batch "
        "axis is not the first; for a Triton model folder, each config field snoozeml owns and changed, and the "
        "promises that do not hold for its kind)",
    )


class ModelDetail(ModelSummary):
    deployment: dict[str, Any] = Field(description="The deployment settings it was published with")
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    params: dict[str, Any]
    metadata: dict[str, Any] = Field(description="Capability/interface metadata from the package manifest")
    versions: list[str] = Field(
        default_factory=lambda: ["1"], description="The versions Triton serves (a Triton folder's version_policy)"
    )
    config: str = Field(description="The generated config.pbtxt (a Triton model folder's own, as published)")
    stats: dict[str, Any] | None = Field(None, description="Triton's inference statistics while loaded")


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instances: int | None = Field(None, ge=1, description="Instances to load (default: the deployment's)")
