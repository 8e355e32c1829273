--# Adds the package's line after Triton's shape errors (HTTP 400 body, gRPC INVALID_ARGUMENT).
--# Parameters: ready_dir (a Lua string of ReadyFlags' folder with a trailing slash, "" for none).
local READY_DIR = {{ ready_dir }}
-- A loaded model's ready flag holds the control plane's line on its inputs (ReadyFlags).
local function declared_inputs(model)
  if READY_DIR == "" or string.sub(model, 1, 1) == "." or string.find(model, "/", 1, true) then
    return nil
  end
  local f = io.open(READY_DIR .. model, "rb")
  if f == nil then return nil end
  local line = f:read("*l")
  f:close()
  if line == nil or line == "" then return nil end
  return line
end
local function hint(msg)
  local input, model = string.match(msg, "unexpected inference input '([^']*)' for model '([^']*)'")
  if input ~= nil then
    return declared_inputs(model)
  end
  input, model = string.match(msg, "unexpected shape for input '([^']*)' for model '([^']*)'")
  if input ~= nil then
    local expected, got = string.match(msg, "Expected %[([^%]]*)%], got %[([^%]]*)%]")
    if expected == nil then return nil end
    if string.find(msg, "max_batch_size", 1, true) == nil then
      return "snoozeml: model '" .. model .. "' does not batch (max_batch_size 0): its input '" .. input
        .. "' is declared with dims [" .. expected .. "] (-1 = any size); send exactly that shape, not ["
        .. got .. "]"
    end
    local dims = string.gsub(expected, "^%-1,?", "")
    local send = dims == "" and "[n]" or ("[n," .. dims .. "]")
    return "snoozeml: model '" .. model .. "' declares input '" .. input .. "' with dims [" .. dims
      .. "] (without the batch axis; -1 = any size): send shape " .. send
      .. ", n items in the request (n = 1 for one item), not [" .. got .. "]"
  end
  input, model = string.match(msg, "input '([^']*)' batch size does not match other inputs for '([^']*)'")
  if input ~= nil then
    return "snoozeml: the first axis of every input of model '" .. model .. "' is the batch axis, the"
      .. " same n in all of them: send each input as [n, <its dims>] (dims are declared without the"
      .. " batch axis); input '" .. input .. "' has another first axis, or none"
  end
  return nil
end
function envoy_on_response(handle)
  local headers = handle:headers()
  local status = headers:get(":status")
  if status == "400" then
    local body = handle:body()
    if body == nil then return end
    local text = body:getBytes(0, body:length())
    local line = hint(text)
    if line == nil then return end
    local head, tail = string.match(text, '^(.*)("%s*}%s*)$')
    if head == nil then return end
    line = string.gsub(string.gsub(line, "\\", "\\\\"), '"', '\\"')
    body:setBytes(head .. "\\n" .. line .. tail)
  elseif headers:get("grpc-status") == "3" then
    local message = headers:get("grpc-message")
    local line = message and hint(message)
    if line == nil then return end
    line = string.gsub(line, "%%", "%%25")
    headers:replace("grpc-message", message .. "%0A" .. line)
  end
end
