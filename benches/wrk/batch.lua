-- 1,000 messages per request, due in an hour:
--   wrk -t2 -c8 -d10s -s benches/wrk/batch.lua http://127.0.0.1:7070/v1/messages/batch
local one = '{"topic":"bench","body":"' .. string.rep("x", 100) .. '","delay":"1h"}'
local messages = {}
for i = 1, 1000 do messages[i] = one end
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"messages":[' .. table.concat(messages, ",") .. ']}'
