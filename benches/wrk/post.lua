-- One message per request, due in an hour (so nothing is delivered during the run):
--   wrk -t2 -c64 -d10s -s benches/wrk/post.lua http://127.0.0.1:7070/v1/messages
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"topic":"bench","body":"' .. string.rep("x", 100) .. '","delay":"1h"}'
