"""Stream tokens from a rolling-batch model over HTTP (LMI jsonlines) and print the per-request timings.

    python examples/clients/http_stream.py --url http://127.0.0.1:8080 --model smollm2 "Hello"
"""

from __future__ import annotations

import argparse
import json

import httpx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    body = {"inputs": args.prompt, "parameters": {"max_new_tokens": args.max_new_tokens}, "stream": True}
    with httpx.stream("POST", f"{args.url}/predictions/{args.model}", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"{r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line:
                continue
            event = json.loads(line)
            if event.get("token"):
                print(event["token"]["text"], end="", flush=True)
            if event.get("generated_text") is not None:
                print("\n---\nfinish:", event["details"]["finish_reason"], "timings:", event.get("timings"))


if __name__ == "__main__":
    main()
