#!/usr/bin/env bash
# LMI, streaming, OpenAI and management calls against a local rollserve (`serving` in the repo root).
set -euo pipefail
H=${H:-http://127.0.0.1:8080}
M=${M:-http://127.0.0.1:8081}
MODEL=${MODEL:-tiny-llama}
# The management API needs the management token from the key file the server wrote (in its working directory).
KEY_FILE=${KEY_FILE:-key_file.json}
AUTH="Authorization: Bearer $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['management']['key'])" "$KEY_FILE")"

curl -s "$H/ping"; echo
curl -s -X POST "$H/predictions/$MODEL" -H 'content-type: application/json' \
  -d '{"inputs": "Deep learning is", "parameters": {"max_new_tokens": 16, "details": true}}'; echo
curl -s -X POST "$H/invocations" -H 'content-type: application/json' \
  -d '{"inputs": ["one", "two"], "parameters": {"max_new_tokens": 8}}'; echo
# Token streaming (rolling-batch models): jsonlines, one object per token.
curl -s -N -X POST "$H/predictions/$MODEL" -H 'content-type: application/json' \
  -d '{"inputs": "Stream me", "parameters": {"max_new_tokens": 8}, "stream": true}' || true; echo
curl -s -X POST "$H/v1/chat/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 8}" || true; echo
curl -s -H "$AUTH" "$M/models"; echo
curl -s -H "$AUTH" "$M/models/$MODEL"; echo
curl -s -H "$AUTH" "$M/metrics" | head -20 || true
