--# Marks the answers of Triton that did not run the request (on the infer_http cluster): a dead stub's 500 and a
--# missing model's 404 or 503, each known only by its whole body. Parameter: marks (a Lua table of
--# {body pattern, header name} pairs, Lua strings each). The retry policy matches the header.
local marks = {{ marks }}

function envoy_on_response(handle)
  local body = handle:body()
  if body == nil then
    return
  end
  local text = body:getBytes(0, body:length())
  for _, mark in ipairs(marks) do
    if string.find(text, mark[1]) then
      handle:headers():add(mark[2], "1")
      return
    end
  end
end
