"""Java .properties parsing: separators, comments, continuations, escapes, duplicates, line numbers."""

from __future__ import annotations

import pytest

from rollcore.errors import ConfigError
from serving.config.properties import Property, parse_properties


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("a=1\n", [("a", "1", 1)], id="equals"),
        pytest.param("a:1\n", [("a", "1", 1)], id="colon"),
        pytest.param("a 1\n", [("a", "1", 1)], id="space"),
        pytest.param("a\t1\n", [("a", "1", 1)], id="tab"),
        pytest.param("  a  =  1\n", [("a", "1", 1)], id="whitespace-around-separator"),
        pytest.param("a = x=y:z\n", [("a", "x=y:z", 1)], id="separators-in-value"),
        pytest.param("a\n", [("a", "", 1)], id="key-only"),
        pytest.param("a=1", [("a", "1", 1)], id="no-final-newline"),
        pytest.param("# c\n! c\na=1\n", [("a", "1", 3)], id="comments-hash-and-bang"),
        pytest.param("  # indented comment\na=1\n", [("a", "1", 2)], id="indented-comment"),
        pytest.param("\n\n   \na=1\n\nb=2\n", [("a", "1", 4), ("b", "2", 6)], id="blank-lines"),
        pytest.param("a = x\\\n    y\\\n  z\nb=2\n", [("a", "xyz", 1), ("b", "2", 4)], id="continuation"),
        pytest.param("a=1\\\n\nb=2\n", [("a", "1", 1), ("b", "2", 3)], id="continuation-into-blank"),
        pytest.param("a=x\\\\\nb=2\n", [("a", "x\\", 1), ("b", "2", 2)], id="escaped-backslash-no-continuation"),
        pytest.param("k\\ ey\\=x\\:y = v\n", [("k ey=x:y", "v", 1)], id="escaped-separators-in-key"),
        pytest.param("a=tab\\there\\nnl\n", [("a", "tab\there\nnl", 1)], id="escapes"),
        pytest.param("a=\\u00e9t\\u00E9\n", [("a", "été", 1)], id="unicode-escape"),
        pytest.param("\\u0041=x\n", [("A", "x", 1)], id="unicode-escape-in-key"),
        pytest.param("a=é\n", [("a", "é", 1)], id="utf8-text"),
        pytest.param("a=1 \n", [("a", "1 ", 1)], id="trailing-space-kept"),
        pytest.param("a=1\r\nb=2\r\n", [("a", "1", 1), ("b", "2", 2)], id="crlf"),
        pytest.param("a=1\rb=2\r", [("a", "1", 1), ("b", "2", 2)], id="cr"),
        pytest.param("a=1\nb=2\na=3\n", [("b", "2", 2), ("a", "3", 3)], id="duplicate-last-wins"),
        pytest.param("", [], id="empty"),
        pytest.param("# only\n\n", [], id="only-comments"),
    ],
)
def test_parse_properties(text: str, expected: list[tuple[str, str, int]]) -> None:
    assert parse_properties(text, "x.properties") == [Property(*entry) for entry in expected]


def test_line_numbers_after_continuations_and_comments() -> None:
    text = "# header\n\nbatch_size=2\noption.a = one \\\n  two\n! note\noption.b:3\n"
    assert [(p.key, p.line) for p in parse_properties(text, "f")] == [
        ("batch_size", 3), ("option.a", 4), ("option.b", 7)]


@pytest.mark.parametrize("text", ["a=1\nb=\\u12\n", "a=1\nb=\\uzzzz\n"])
def test_invalid_unicode_escape_names_file_and_line(text: str) -> None:
    with pytest.raises(ConfigError, match=r"serving\.properties:2: invalid unicode escape"):
        parse_properties(text, "serving.properties")


def test_property_is_frozen() -> None:
    prop = Property("a", "1", 1)
    with pytest.raises(AttributeError):
        prop.value = "2"  # type: ignore[misc]
