--# Included by the gRPC wake filter (no parameters): string_field(s, wanted) reads field `wanted`
--# (a string) of a protobuf message that starts at byte 6 of s (after 5 bytes of gRPC framing).

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
