"""A custom handler in DJL's style: module-level ``initialize`` and ``handle`` functions.

Serve it with:  serving -m custom=examples/models/custom-handler
Then:           curl -s -X POST localhost:8080/predictions/custom -d '{"inputs": "Hello", "shout": true}'
"""

from __future__ import annotations

from handlers.base import Context, Input, Output

_greeting = "hello"


def initialize(ctx: Context) -> None:
    """Called once in the worker process; ``ctx.properties`` holds serving.properties (option. stripped)."""
    global _greeting
    _greeting = ctx.option("greeting", "hello") or "hello"


def handle(inputs: list[Input]) -> list[Output]:
    """One output per input; a failing item fails alone."""
    outputs = []
    for inp in inputs:
        body = inp.payload or {}
        if not inp.prompt:
            outputs.append(Output.failure(inp.request_id, "'inputs' must be a non-empty string"))
            continue
        text = f"{_greeting}, {inp.prompt}"
        if body.get("shout") is True:
            text = text.upper()
        outputs.append(Output(request_id=inp.request_id, payload={"reply": text, "length": len(text)}))
    return outputs
