"""The wake filter: Lua in the gateway's Envoy that wakes a model before a request Envoy cannot retry moves on
(``lua/http_wake.lua``, ``lua/grpc_wake.lua``, filled in by ``lua.program``).

Envoy's retry-to-activator path re-sends a buffered request, so it cannot serve a stream (Triton reports
an unknown model as a message on the stream; a stream cannot be re-sent once bytes went upstream) nor a
body larger than ``wake_buffer_bytes``. For those the filter decides before the body moves on:

- which requests: gRPC ``ModelStreamInfer`` and HTTP ``/generate_stream`` (every one: a stream also
  holds its model awake while it is open), and HTTP ``/infer`` / ``/generate`` whose ``content-length``
  is over ``wake_buffer_bytes`` (or absent: chunked). Smaller HTTP requests and every unary gRPC
  ``ModelInfer`` pass untouched: the retry path serves them (gRPC carries no content-length, so its retry
  buffer is as large as a message Triton accepts, ``envoy.GRPC_RETRY_BUFFER_BYTES``); warm ones never
  touch Lua or Python;
- the model: HTTP from the path; on a ``ModelStreamInfer`` stream, from field 1 of every message: each READY
  model the stream names is held (once) as its first message goes on, and each sleeping one is woken before
  its message moves on. A filter reads no further after a wake it waited for (Envoy's Lua lets a chunk held
  across a call it waited for go only when the script ends), so the gRPC listener chains
  ``STREAM_WAKE_STAGES`` filters: the next one takes over at the message after the woken one (its body offset
  in the dynamic metadata). A stream wakes up to that many sleeping models; one more first named on it gets
  Triton's answer on the stream;
- how, cold: it waits for the first body chunk (so the request headers have already gone on, and Envoy
  applies flow control instead of a 413 while it holds the body), calls the activator's
  ``POST /_snooze/hold/<model>`` (``x-snooze-hold: <token>``), which wakes the model (single flight)
  and returns once it is READY, then lets the held chunk and the rest of the body through to Triton.
  Nothing is buffered for a retry and nothing is sent twice;
- how, warm: the control plane keeps one empty file per READY model in ``ready_dir`` (``ReadyFlags``:
  created when the lifecycle says READY, removed the moment it says anything else, before the transition
  awaits anything). When the model's file is there, the filter sends the same hold call asynchronously
  (Envoy does not wait for its answer) and lets the request on at once: a warm stream's first message
  never waits for Python. The call still reaches the activator (within a millisecond here), so the model
  counts as in use while the stream is open; an idle unload or eviction that started in between re-checks
  the model's users after two round trips to Triton and keeps it (``transitions.Unloads.unload_op``);
- the hold: the activator keeps the model in use (no idle unload, no eviction, no scale-down) from that
  call until the request ends. Its end, normal or a reset (also one during the wake), is one line of an
  Envoy access log filtered on the dynamic metadata the filter sets before the call (``snoozeml.hold``:
  the token), which the activator tails (``activator.HoldRegistry``); an unknown model or a failed load
  holds nothing, and its logged end is forgotten after a while.

A request the activator cannot hold (unknown model, failed load) goes on to Triton unchanged: its
answer, in Triton's words, is the client's.
"""

from __future__ import annotations

from pathlib import Path

from controlplane.gateway import grpc_names
from controlplane.gateway.lua import lua_string, program
from controlplane.settings import Settings

HOLD_PATH = "/_snooze/hold/"
HOLD_HEADER = "x-snooze-hold"
HOLD_WARM_HEADER = "x-snooze-hold-warm"  # the filter found the model's ready flag and did not wait
METADATA_NAMESPACE = "snoozeml"
METADATA_KEY = "hold"
GRPC_SERVICE = grpc_names.path("")


def held_log_path(settings: Settings) -> Path:
    """Envoy's access log of held requests' ends (the wake filter's), read by the activator."""
    return settings.work_dir / "gateway-held.log"


def ready_dir_path(settings: Settings) -> Path:
    """The folder of ready flags (one empty file per READY model) the wake filter reads (``ReadyFlags``)."""
    return settings.work_dir / "gateway-ready"


# The names hold.lua's call and metadata use (included by both wake filters).
_HOLD_PARAMS = {
    "metadata_namespace": METADATA_NAMESPACE,
    "metadata_key": METADATA_KEY,
    "hold_path": HOLD_PATH,
    "hold_header": HOLD_HEADER,
    "hold_warm_header": HOLD_WARM_HEADER,
}


def _ready_dir(ready_dir: str | None) -> str:
    """``READY_DIR`` for the Lua: a long-bracket string of the folder with a trailing slash, or nil."""
    return "nil" if ready_dir is None else lua_string(ready_dir.rstrip("/") + "/")


def http_wake_lua(wake_buffer_bytes: int, ready_dir: str | None = None) -> str:
    """The HTTP listener's wake filter (``model`` from the path); ``ready_dir``: ``ReadyFlags``' folder
    (None: no warm path, every hold waits for the activator)."""
    return program(
        "http_wake", ready_dir=_ready_dir(ready_dir), wake_buffer_bytes=int(wake_buffer_bytes), **_HOLD_PARAMS
    )


STREAM_WAKE_STAGES = 4  # wake filters on the gRPC listener: how many sleeping models one stream can wake
STAGE_FROM_KEY = "stream_from_"  # + stage: the body offset (bytes) where that stage takes over
STAGE_MODELS_KEY = "stream_models"  # models the earlier stages held, joined by commas


def grpc_wake_lua(ready_dir: str | None = None, stage: int = 1, stages: int = 1) -> str:
    """One gRPC stream wake filter: stage 1 takes a ``ModelStreamInfer`` stream's models from field 1 of each
    message until the first model it has to wake (waiting ends the script: Envoy
    lets the chunk it held across that call go only then). Stage ``k`` > 1 (the next filter in the chain) takes
    over a stream where stage ``k - 1`` ended after such a wake: the message after the woken one, found from
    the body offset stage ``k - 1`` left in the dynamic metadata, with the models and hold tokens it had."""
    return program(
        "grpc_wake",
        ready_dir=_ready_dir(ready_dir),
        stage=int(stage),
        stages=int(stages),
        grpc_service=GRPC_SERVICE,
        stage_from_key=STAGE_FROM_KEY,
        stage_models_key=STAGE_MODELS_KEY,
        **_HOLD_PARAMS,
    )


def grpc_wake_chain(ready_dir: str | None = None, stages: int = STREAM_WAKE_STAGES) -> list[str]:
    """The gRPC listener's wake filters, in chain order: a stream wakes up to ``stages`` sleeping models."""
    return [grpc_wake_lua(ready_dir, stage, stages) for stage in range(1, stages + 1)]
