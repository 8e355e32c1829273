--# Included by the wake filters: warm(model) and hold(handle, model, id, earlier). Parameters:
--# metadata_namespace, metadata_key, hold_path, hold_header, hold_warm_header (wake_lua's constants);
--# the including program defines READY_DIR.

-- The hold's token is set before the call: a request that ends during the wake is logged too, and
-- the activator releases a hold whose end it saw first. Unique without trusting x-request-id (a client
-- may send its own): this worker's Lua state (a table's address) and a counter of its own.
local SALT = string.gsub(tostring({}), "^table: ", "")
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
  handle:streamInfo():dynamicMetadata():set("{{ metadata_namespace }}", "{{ metadata_key }}", tokens)
  local headers = {
    [":method"] = "POST",
    [":path"] = "{{ hold_path }}" .. model,
    [":authority"] = "activator",
    ["{{ hold_header }}"] = token,
  }
  if warm(model) then
    headers["{{ hold_warm_header }}"] = "1"
    handle:httpCall("activator_http", headers, nil, {["asynchronous"] = true})
    return tokens, false
  end
  handle:httpCall("activator_http", headers, nil, 0)
  return tokens, true
end
