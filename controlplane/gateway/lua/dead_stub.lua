--# Marks Triton's 500 for a dead stub (on the infer_http cluster). Parameters: dead_stub_body_pattern
--# (a Lua string of the body's pattern), dead_stub_header (a Lua string of the header's name).
function envoy_on_response(handle)
  if handle:headers():get(":status") ~= "500" then
    return
  end
  local body = handle:body()
  if body ~= nil and string.find(body:getBytes(0, body:length()), {{ dead_stub_body_pattern }}) then
    handle:headers():add({{ dead_stub_header }}, "1")
  end
end
