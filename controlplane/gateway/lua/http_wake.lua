--# The HTTP listener's wake filter (wake_lua.http_wake_lua). Parameters: ready_dir (a Lua string
--# of ReadyFlags' folder with a trailing slash, or nil), wake_buffer_bytes.
local READY_DIR = {{ ready_dir }}
--#include hold.lua

local WAKE_BUFFER = {{ wake_buffer_bytes }}

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
