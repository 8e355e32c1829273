--# One gRPC stream wake filter of the chain (wake_lua.grpc_wake_lua), on ModelStreamInfer only (a unary
--# ModelInfer is woken by the retry). Parameters: ready_dir (as in http_wake.lua), stage, stages,
--# grpc_service, metadata_namespace, metadata_key, stage_from_key, stage_models_key.
local READY_DIR = {{ ready_dir }}
--#include protobuf.lua
--#include hold.lua

local STAGE, STAGES = {{ stage }}, {{ stages }}
local STREAM = "{{ grpc_service }}ModelStreamInfer"
local NAME_BYTES = 512  -- of a message read for its model name (field 1, first on the wire)

local function frame_size(s)
  return ((s:byte(2) * 256 + s:byte(3)) * 256 + s:byte(4)) * 256 + s:byte(5)
end

function envoy_on_request(handle)
  if handle:headers():get(":path") ~= STREAM then
    return
  end
  local id = handle:headers():get("x-request-id") or ""
  -- A stream: each message's model is held (once) before that message moves on, until the first model
  -- that had to be woken: after a call the filter waited for, Envoy lets the held chunk go only when
  -- this script ends, so it ends there, and the next stage (if any) goes on from the next message. Frames
  -- may span chunks: ``head`` collects a frame's 5-byte header and the start of its message (enough for
  -- field 1), ``skip`` is what is left of the frame; ``total`` counts the body's bytes before this chunk.
  local models, names, tokens, head, skip = {}, "", nil, "", 0
  local from, total = nil, 0  -- where in the body this stage takes over (stage 1: at once)
  if STAGE == 1 then
    from = 0
  end
  for chunk in handle:bodyChunks() do
    local length = chunk:length()
    if from == nil then
      local earlier = handle:streamInfo():dynamicMetadata():get("{{ metadata_namespace }}")
      if earlier ~= nil and earlier["{{ stage_from_key }}" .. STAGE] ~= nil then
        from = earlier["{{ stage_from_key }}" .. STAGE]
        tokens = earlier["{{ metadata_key }}"]
        names = earlier["{{ stage_models_key }}"] or ""
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
                metadata:set("{{ metadata_namespace }}", "{{ stage_models_key }}", names)
                metadata:set("{{ metadata_namespace }}", "{{ stage_from_key }}" .. (STAGE + 1), total + at + skip)
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
