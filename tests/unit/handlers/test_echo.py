"""EchoHandler: echoes prompts, fails only the matching item, sleeps per batch, never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import handlers.echo
from handlers.base import Context, Input
from handlers.echo import EchoHandler
from rollcore.errors import ErrorKind
from rollcore.types import FinishReason


def make_echo(**options: str) -> EchoHandler:
    handler = EchoHandler()
    handler.initialize(Context(model_name="echo", model_dir=Path("."), properties=options))
    return handler


def test_echoes_prompt_with_one_token_per_word() -> None:
    [out] = make_echo().handle([Input(request_id="r1", prompt="hello big world")])
    assert out.request_id == "r1"
    assert out.text == "hello big world"
    assert out.finish_reason is FinishReason.LENGTH
    assert [(t.id, t.text) for t in out.tokens] == [(0, "hello"), (1, "big"), (2, "world")]
    assert out.prompt_tokens == 3
    assert out.error is None


def test_returns_payload_when_there_is_no_prompt() -> None:
    [out] = make_echo().handle([Input(request_id="r1", prompt="", payload={"x": [1, 2]})])
    assert out.payload == {"x": [1, 2]}
    assert out.text == ""
    assert out.error is None


def test_fail_on_fails_only_matching_item() -> None:
    outs = make_echo(echo_fail_on="BOOM").handle(
        [Input("a", "fine"), Input("b", "this goes BOOM"), Input("c", "also fine")])
    assert [o.request_id for o in outs] == ["a", "b", "c"]
    assert outs[0].text == "fine" and outs[2].text == "also fine"
    assert outs[1].error is not None and "BOOM" in outs[1].error
    assert outs[1].finish_reason is FinishReason.ERROR
    assert outs[1].error_kind is ErrorKind.HANDLER


def test_delay_is_per_batch_not_per_item(monkeypatch: pytest.MonkeyPatch) -> None:
    handler = make_echo(echo_delay_ms="50")
    sleeps: list[float] = []
    monkeypatch.setattr(handlers.echo.time, "sleep", sleeps.append)
    outs = handler.handle([Input(str(i), f"p{i}") for i in range(5)])
    assert len(outs) == 5
    assert sleeps == [0.05]


def test_describe() -> None:
    assert make_echo().describe() == {"max_model_len": 100000}


def test_import_does_not_pull_torch() -> None:
    code = "import sys, handlers.echo, handlers.loader; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])
