"""docs/reference.md is what ``serving.config.reference`` renders from the key tables and the option schema."""

from __future__ import annotations

from dataclasses import replace

from rollcore.options import OPTIONS
from serving.config import reference
from serving.config.keys import MODEL_KEYS


def test_the_committed_reference_is_the_rendered_one() -> None:
    assert reference.PATH.read_text() == reference.render(), "run: python -m serving.config.reference"
    assert reference.main(["--check"]) == 0


def test_every_key_and_option_is_in_the_reference_with_its_default() -> None:
    text = reference.render()
    for spec in MODEL_KEYS.values():
        assert f"| `{spec.key}` |" in text
    for spec in OPTIONS.values():
        shown = "(unset)" if spec.default is None else f"`{spec.default}`"
        assert f"| `option.{spec.key}` | {shown} |" in text


def test_a_changed_default_makes_the_reference_stale(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    changed = dict(OPTIONS)
    changed["block_size"] = replace(OPTIONS["block_size"], default="32")
    monkeypatch.setattr(reference, "OPTIONS", changed)
    assert reference.main(["--check"]) == 1
