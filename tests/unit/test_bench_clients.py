"""How ``serving bench``'s LMI client reads a streamed answer: token lines, or a whole answer (dynamic batching)."""

from __future__ import annotations

import json

from serving.bench.clients import _lmi_line
from serving.bench.run_metrics import Rec


def test_token_lines_are_counted_one_by_one() -> None:
    rec = Rec(send=0.0)
    for i, t in enumerate((1.0, 1.5, 2.0)):
        _lmi_line(json.dumps({"token": {"id": 7 + i, "text": "x"}}), rec, t)
    _lmi_line(json.dumps({"token": {"id": 9, "text": "x"}, "generated_text": "xyz",
                          "details": {"finish_reason": "length", "generated_tokens": 4}}), rec, 2.5)
    assert (rec.token_times, rec.num_tokens, rec.error) == ([1.0, 1.5, 2.0, 2.5], 4, None)


def test_a_whole_answer_to_a_streamed_request_counts_its_tokens_at_once() -> None:
    """A dynamic-batching model answers ``stream: true`` whole: its tokens all arrive with it (they were counted
    as none, so every request of such a run failed)."""
    rec = Rec(send=0.0)
    _lmi_line(json.dumps({"generated_text": "a b c", "details": {"finish_reason": "length",
                                                                 "generated_tokens": 12}}), rec, 3.0)
    assert (rec.token_times, rec.num_tokens, rec.done, rec.error) == ([3.0], 12, 3.0, None)


def test_an_error_ends_the_stream_as_failed() -> None:
    rec = Rec(send=0.0)
    _lmi_line(json.dumps({"token": {"id": 5, "text": "x"}}), rec, 1.0)
    _lmi_line(json.dumps({"generated_text": "x", "details": {"finish_reason": "error"}}), rec, 1.2)
    assert rec.error == "stream ended with error" and rec.num_tokens == 1
