"""The wake filter: Lua in the gateway's Envoy that wakes a model before a request Envoy cannot retry moves on.

Envoy's retry-to-activator path re-sends a buffered request, so it cannot serve a stream (Triton reports
an unknown model as a message on the stream; a stream cannot be re-sent once bytes went upstream) nor a
body larger than ``wake_buffer_bytes``. For those the filter decides before the body moves on:

- which requests: gRPC ``ModelStreamInfer`` and HTTP ``/generate_stream`` (every one: a stream also
  holds its model awake while it is open), gRPC ``ModelInfer`` whose message (the gRPC frame's length)
  and HTTP ``/infer`` / ``/generate`` whose ``content-length`` is over ``wake_buffer_bytes`` (or absent:
  chunked). Smaller unary requests pass untouched (the retry path serves them; warm ones never touch
  Python);
- the model: HTTP from the path, gRPC from field 1 of the message (the same protobuf walk the fleet
  gateway uses); on a ``ModelStreamInfer`` stream, of every message: each READY model the stream names is
  held (once) as its first message goes on, and each sleeping one is woken before its message moves on. A
  filter reads no further after a wake it waited for (Envoy's Lua lets a chunk held across a call it waited
  for go only when the script ends), so the gRPC listener chains ``STREAM_WAKE_STAGES`` filters: the next
  one takes over at the message after the woken one (its body offset in the dynamic metadata). A stream
  wakes up to that many sleeping models; one more first named on it gets Triton's answer on the stream;
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
  the model's users after two round trips to Triton and keeps it (``LifecycleManager._unload_op``);
- the hold: the activator keeps the model in use (no idle unload, no eviction, no scale-down) from that
  call until the request ends. Its end, normal or a reset (also one during the wake), is one line of an
  Envoy access log filtered on the dynamic metadata the filter sets before the call (``snoozeml.hold``:
  the token), which the activator tails (``activator.HoldRegistry``); an unknown model or a failed load
  holds nothing, and its logged end is forgotten after a while.

A request the activator cannot hold (unknown model, failed load) goes on to Triton unchanged: its
answer, in Triton's words, is the client's.
"""

from __future__ import annotations

from controlplane.gateway import grpc_names

HOLD_PATH = "/_snooze/hold/"
HOLD_HEADER = "x-snooze-hold"
HOLD_WARM_HEADER = "x-snooze-hold-warm"  # the filter found the model's ready flag and did not wait
METADATA_NAMESPACE = "snoozeml"
METADATA_KEY = "hold"
GRPC_SERVICE = grpc_names.path("")

# Field ``wanted`` (a string) of a protobuf message that starts at byte 6 of ``s`` (after 5 bytes of
# gRPC framing): a small walk over the wire format, enough for the first fields of a request.
LUA_PROTOBUF_STRING_FIELD = """
local function varint(s, i)
  local value, scale = 0, 1
  while i <= #s do
    local b = s:byte(i)
    i = i + 1
    value = value + (b % 128) * scale
    if b < 128 then
      return value, i
    end
    scale = scale * 128
  end
  return nil, i
end

local function string_field(s, wanted)
  local i = 6
  while i <= #s do
    local key
    key, i = varint(s, i)
    if key == nil then
      return nil
    end
    local number, wire = math.floor(key / 8), key % 8
    if wire == 2 then
      local size
      size, i = varint(s, i)
      if size == nil then
        return nil
      end
      if number == wanted then
        return s:sub(i, i + size - 1)
      end
      i = i + size
    elseif wire == 0 then
      local _
      _, i = varint(s, i)
    elseif wire == 1 then
      i = i + 8
    elseif wire == 5 then
      i = i + 4
    else
      return nil
    end
  end
  return nil
end
"""

_HOLD = f"""
-- The hold's token is set before the call: a request that ends during the wake is logged too, and
-- the activator releases a hold whose end it saw first. Unique without trusting x-request-id (a client
-- may send its own): this worker's Lua state (a table's address) and a counter of its own.
local SALT = string.gsub(tostring({{}}), "^table: ", "")
local held = 0

-- READY models have a file in READY_DIR (the control plane's ReadyFlags): one open() on a small local
-- file, no Python. Names starting with a dot are never flags (no "..").
local function warm(model)
  if READY_DIR == nil or string.sub(model, 1, 1) == "." then
    return false
  end
  local f = io.open(READY_DIR .. model, "rb")
  if f == nil then
    return false
  end
  f:close()
  return true
end

-- A request may hold several models (a gRPC stream whose messages name several): the metadata value
-- is their tokens joined by commas (the activator splits the logged line).
local function hold(handle, model, id, earlier)
  held = held + 1
  local token = string.gsub(id, "[^%w%-]", "") .. "-" .. SALT .. "-" .. held
  local tokens = earlier == nil and token or (earlier .. "," .. token)
  handle:streamInfo():dynamicMetadata():set("{METADATA_NAMESPACE}", "{METADATA_KEY}", tokens)
  local headers = {{
    [":method"] = "POST",
    [":path"] = "{HOLD_PATH}" .. model,
    [":authority"] = "activator",
    ["{HOLD_HEADER}"] = token,
  }}
  if warm(model) then
    headers["{HOLD_WARM_HEADER}"] = "1"
    handle:httpCall("activator_http", headers, nil, {{["asynchronous"] = true}})
    return tokens, false
  end
  handle:httpCall("activator_http", headers, nil, 0)
  return tokens, true
end
"""


def _ready_dir(ready_dir: str | None) -> str:
    """``READY_DIR`` for the Lua: a long-bracket string of the folder with a trailing slash, or nil."""
    if ready_dir is None:
        return "local READY_DIR = nil\n"
    text = ready_dir.rstrip("/") + "/"
    level = 1
    while f"]{'=' * level}]" in text:
        level += 1
    return f"local READY_DIR = [{'=' * level}[{text}]{'=' * level}]\n"


def http_wake_lua(wake_buffer_bytes: int, ready_dir: str | None = None) -> str:
    """The HTTP listener's wake filter (``model`` from the path); ``ready_dir``: ``ReadyFlags``' folder
    (None: no warm path, every hold waits for the activator)."""
    return (
        _ready_dir(ready_dir)
        + _HOLD
        + f"""
local WAKE_BUFFER = {int(wake_buffer_bytes)}

function envoy_on_request(handle)
  local headers = handle:headers()
  local path = headers:get(":path") or ""
  local model, rest = string.match(path, "^/v2/models/([%w_%.%-]+)(/[^?]*)")
  if model == nil then
    return
  end
  rest = string.gsub(rest, "^/versions/[^/]+", "")
  if rest ~= "/generate_stream" then
    if rest ~= "/infer" and rest ~= "/generate" then
      return
    end
    local length = tonumber(headers:get("content-length") or "")
    if length ~= nil and length <= WAKE_BUFFER then
      return
    end
  end
  local id = headers:get("x-request-id") or ""
  for _ in handle:bodyChunks() do
    hold(handle, model, id)
    return
  end
end
"""
    )


STREAM_WAKE_STAGES = 4  # wake filters on the gRPC listener: how many sleeping models one stream can wake
STAGE_FROM_KEY = "stream_from_"  # + stage: the body offset (bytes) where that stage takes over
STAGE_MODELS_KEY = "stream_models"  # models the earlier stages held, joined by commas


def grpc_wake_lua(wake_buffer_bytes: int, ready_dir: str | None = None, stage: int = 1, stages: int = 1) -> str:
    """One gRPC wake filter: stage 1 takes a large ``ModelInfer``'s model from field 1 of its message, and a
    stream's from field 1 of each message until the first model it has to wake (waiting ends the script: Envoy
    lets the chunk it held across that call go only then). Stage ``k`` > 1 (the next filter in the chain) takes
    over a stream where stage ``k - 1`` ended after such a wake: the message after the woken one, found from
    the body offset stage ``k - 1`` left in the dynamic metadata, with the models and hold tokens it had."""
    return (
        _ready_dir(ready_dir)
        + LUA_PROTOBUF_STRING_FIELD
        + _HOLD
        + f"""
local WAKE_BUFFER = {int(wake_buffer_bytes)}
local STAGE, STAGES = {int(stage)}, {int(stages)}
local STREAM = "{GRPC_SERVICE}ModelStreamInfer"
local NAME_BYTES = 512  -- of a message read for its model name (field 1, first on the wire)

local function frame_size(s)
  return ((s:byte(2) * 256 + s:byte(3)) * 256 + s:byte(4)) * 256 + s:byte(5)
end
local UNARY = "{GRPC_SERVICE}ModelInfer"

function envoy_on_request(handle)
  local path = handle:headers():get(":path")
  if path ~= STREAM and (STAGE > 1 or path ~= UNARY) then
    return
  end
  local id = handle:headers():get("x-request-id") or ""
  if path == UNARY then
    for chunk in handle:bodyChunks() do
      -- The route sent only requests without a small content-length here: gRPC's carry none, so the
      -- frame's 5-byte header says the size; the model's name is read only for a large one.
      if chunk:length() < 5 or frame_size(chunk:getBytes(0, 5)) <= WAKE_BUFFER then
        return
      end
      local model = string_field(chunk:getBytes(0, math.min(chunk:length(), 4096)), 1)
      if model ~= nil and string.match(model, "^[%w_%.%-]+$") then
        hold(handle, model, id)
      end
      return
    end
    return
  end
  -- A stream: each message's model is held (once) before that message moves on, until the first model
  -- that had to be woken: after a call the filter waited for, Envoy lets the held chunk go only when
  -- this script ends, so it ends there, and the next stage (if any) goes on from the next message. Frames
  -- may span chunks: ``head`` collects a frame's 5-byte header and the start of its message (enough for
  -- field 1), ``skip`` is what is left of the frame; ``total`` counts the body's bytes before this chunk.
  local models, names, tokens, head, skip = {{}}, "", nil, "", 0
  local from, total = nil, 0  -- where in the body this stage takes over (stage 1: at once)
  if STAGE == 1 then
    from = 0
  end
  for chunk in handle:bodyChunks() do
    local length = chunk:length()
    if from == nil then
      local earlier = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
      if earlier ~= nil and earlier["{STAGE_FROM_KEY}" .. STAGE] ~= nil then
        from = earlier["{STAGE_FROM_KEY}" .. STAGE]
        tokens = earlier["{METADATA_KEY}"]
        names = earlier["{STAGE_MODELS_KEY}"] or ""
        for name in string.gmatch(names, "[^,]+") do
          models[name] = true
        end
      end
    end
    local at = length  -- not this stage's part of the body yet
    if from ~= nil and from < total + length then
      at = math.max(from - total, 0)
    end
    while at < length do
      if skip > 0 then
        local n = math.min(skip, length - at)
        at, skip = at + n, skip - n
      else
        local want = 5 - #head
        if want <= 0 then
          want = math.min(frame_size(head), NAME_BYTES) - (#head - 5)
        end
        local n = math.min(want, length - at)
        head = head .. chunk:getBytes(at, n)
        at = at + n
        if #head >= 5 and #head - 5 >= math.min(frame_size(head), NAME_BYTES) then
          skip = frame_size(head) - (#head - 5)
          local model = string_field(head, 1)
          head = ""
          if model ~= nil and models[model] == nil and string.match(model, "^[%w_%.%-]+$") then
            models[model] = true
            names = names == "" and model or (names .. "," .. model)
            local waited
            tokens, waited = hold(handle, model, id, tokens)
            if waited then
              if STAGE < STAGES then
                local metadata = handle:streamInfo():dynamicMetadata()  -- an object lives until a yield
                metadata:set("{METADATA_NAMESPACE}", "{STAGE_MODELS_KEY}", names)
                metadata:set("{METADATA_NAMESPACE}", "{STAGE_FROM_KEY}" .. (STAGE + 1), total + at + skip)
              end
              return
            end
          end
        end
      end
    end
    total = total + length
  end
end
"""
    )


def grpc_wake_chain(
    wake_buffer_bytes: int, ready_dir: str | None = None, stages: int = STREAM_WAKE_STAGES
) -> list[str]:
    """The gRPC listener's wake filters, in chain order: a stream wakes up to ``stages`` sleeping models."""
    return [grpc_wake_lua(wake_buffer_bytes, ready_dir, stage, stages) for stage in range(1, stages + 1)]
