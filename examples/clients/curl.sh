#!/usr/bin/env bash
# LMI, streaming, OpenAI and management calls against a local rollserve (`serving` in the repo root).
# Any failed call (HTTP status >= 400) stops the script with curl's error.
set -euo pipefail
H=${H:-http://127.0.0.1:8080}
M=${M:-http://127.0.0.1:8081}
MODEL=${MODEL:-smollm2}
CURL=(curl -sS --fail-with-body)
# The management API needs the management token from the key file the server wrote (in its working directory).
KEY_FILE=${KEY_FILE:-key_file.json}
AUTH="Authorization: Bearer $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['management']['key'])" "$KEY_FILE")"

"${CURL[@]}" "$H/ping"; echo
"${CURL[@]}" -X POST "$H/predictions/$MODEL" -H 'content-type: application/json' \
  -d '{"inputs": "Deep learning is", "parameters": {"max_new_tokens": 16, "details": true}}'; echo
"${CURL[@]}" -X POST "$H/invocations?model_name=$MODEL" -H 'content-type: application/json' \
  -d '{"inputs": ["one", "two"], "parameters": {"max_new_tokens": 8}}'; echo
# Token streaming (rolling-batch models, as the default model): jsonlines, one object per token.
"${CURL[@]}" -N -X POST "$H/predictions/$MODEL" -H 'content-type: application/json' \
  -d '{"inputs": "Stream me", "parameters": {"max_new_tokens": 8}, "stream": true}'; echo
"${CURL[@]}" -X POST "$H/v1/chat/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 8}"; echo
"${CURL[@]}" -H "$AUTH" "$M/models"; echo
"${CURL[@]}" -H "$AUTH" "$M/models/$MODEL"; echo
# Change a knob of the live model without a reload (README: "Changing a live model"): the engine's batch limit.
"${CURL[@]}" -X PUT -H "$AUTH" "$M/models/$MODEL?max_rolling_batch_size=32"; echo
"${CURL[@]}" -H "$AUTH" "$M/metrics" | sed -n '/^rollserve_requests_total/p'
