"""The incremental detokenizer emits only the text of generated tokens, whatever the prompt's last bytes are.

The tokenizer is the byte-level BPE of ``handlers.synthetic_model``: every byte is also a token of its own, so
a prompt (token ids) can end inside a UTF-8 character, e.g. with the first two bytes of '東'.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from handlers.engine.core.detokenizer import IncrementalDetokenizer
from handlers.synthetic_model import build_tokenizer
from tests.byte_level import byte_ids, token_id

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, 512)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def words(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def run(tokenizer: Tokenizer, prompt: list[int], generated: list[int], **kw: object) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, **kw)  # type: ignore[arg-type]
    out = [detok.push(t).released for t in generated]
    out.append(detok.flush()[0])
    return out


def test_tokenizer_splits_characters_across_tokens(tokenizer: Tokenizer) -> None:
    ids = byte_ids(tokenizer, "東")
    assert len(ids) == 3 and tokenizer.decode(ids) == "東"
    assert tokenizer.decode(words(tokenizer, "the model server") + ids[:2]).endswith("\ufffd")


@pytest.mark.parametrize(("char", "in_prompt"), [("東", 1), ("東", 2), ("😀", 1), ("😀", 2), ("😀", 3), ("é", 1)])
def test_prompt_ending_mid_character_leaks_nothing(tokenizer: Tokenizer, char: str, in_prompt: int) -> None:
    """The generated tokens complete a character begun in the prompt: the completion holds that character
    (the prompt's text showed only U+FFFD for its bytes) and nothing else of the prompt."""
    head = words(tokenizer, "hello world the model server")
    char_ids = byte_ids(tokenizer, char)
    prompt = [BOS, *head, *char_ids[:in_prompt]]
    generated = [*char_ids[in_prompt:], *words(tokenizer, " hello world")]
    out = run(tokenizer, prompt, generated)
    assert "".join(out) == f"{char} hello world"
    assert out[len(char_ids) - in_prompt - 1] == char  # released by the token that completes it
    assert all(piece == "" for piece in out[:len(char_ids) - in_prompt - 1])


@pytest.mark.parametrize("in_prompt", [1, 2])
def test_prompt_dangling_bytes_not_completed_stay_prompt_text(tokenizer: Tokenizer, in_prompt: int) -> None:
    """The generated tokens do not continue the prompt's incomplete character: its U+FFFD is prompt text."""
    prompt = [BOS, *words(tokenizer, "hello world the model server"), *byte_ids(tokenizer, "東")[:in_prompt]]
    generated = words(tokenizer, " hello world")
    out = run(tokenizer, prompt, generated)
    assert "".join(out) == " hello world" and out[0] == tokenizer.decode(generated[:1]) == " h"


def test_every_cut_of_a_byte_level_prompt(tokenizer: Tokenizer) -> None:
    """Cut a byte-per-token text anywhere: the completion is the text from the start of the character the cut
    falls in (a character begun in the prompt and finished by generation belongs to the completion)."""
    text = "ab 東京 😀 ü — x"
    data = text.encode()
    ids = byte_ids(tokenizer, text)
    for cut in range(len(ids) + 1):
        start = cut
        while start < len(data) and start > 0 and (data[start] & 0xC0) == 0x80:
            start -= 1
        out = run(tokenizer, [BOS, *ids[:cut]], ids[cut:])
        assert "".join(out) == data[start:].decode(), cut


def test_every_cut_of_a_text_prompt(tokenizer: Tokenizer) -> None:
    """The same with the tokenizer's own merges (this 512-token vocabulary splits some characters' bytes
    across tokens): the completion is the text after the prompt's last complete character."""
    text = "Hello 東京 数据 😀 🚀 café über — “quoted” 模型 ✓ naïve"
    ids = words(tokenizer, text)
    assert tokenizer.decode(ids) == text
    mid_character_cuts = 0
    for cut in range(1, len(ids)):
        shown = tokenizer.decode(ids[:cut])
        mid_character_cuts += shown.endswith("\ufffd")
        out = run(tokenizer, [BOS, *ids[:cut]], ids[cut:])
        assert "".join(out) == text[len(shown.rstrip("\ufffd")):], cut
    assert mid_character_cuts >= 3


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    im_start = token_id(tokenizer, "<|im_start|>")
    prompt = [BOS, im_start, *words(tokenizer, "assistant\n"), *byte_ids(tokenizer, "東")[:2]]
    generated = [byte_ids(tokenizer, "東")[2], *words(tokenizer, " one"), im_start, *words(tokenizer, " two"), EOS]
    assert "".join(run(tokenizer, prompt, generated)) == "東 one two"
    assert "".join(run(tokenizer, prompt, generated, skip_special_tokens=False)) == "東 one<|im_start|> two</s>"


def test_stop_string_after_dangling_prompt(tokenizer: Tokenizer) -> None:
    prompt = [BOS, *words(tokenizer, "the"), *byte_ids(tokenizer, "😀")[:2]]
    generated = [*byte_ids(tokenizer, "😀")[2:], *words(tokenizer, " one two three four")]
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=("three",))
    released = ""
    for t in generated:
        step = detok.push(t)
        released += step.released
        if step.stopped:
            break
    assert step.stopped and released == "😀 one two "


def test_incomplete_bytes_at_the_end_are_flushed(tokenizer: Tokenizer) -> None:
    """A request that ends inside a character releases U+FFFD at flush, as decoding its tokens would."""
    generated = [*words(tokenizer, " one"), *byte_ids(tokenizer, "東")[:2]]
    out = run(tokenizer, [BOS, *words(tokenizer, "the")], generated)
    assert out == [" one", "", "", "\ufffd"]
    assert "".join(out) == tokenizer.decode(generated)


def test_stop_token_text_is_not_emitted(tokenizer: Tokenizer) -> None:
    """A token that ends the request as a stop token (stop_token_ids, EOS) contributes no text (as vLLM);
    text held back for stop strings is still released by flush."""
    stop_token = words(tokenizer, " two")[0]
    detok = IncrementalDetokenizer(tokenizer, [BOS], stop=("one tw",))
    first = [detok.push(t) for t in words(tokenizer, "one")]
    step = detok.push(stop_token, stop_token=True)
    assert [s.released for s in first] == [""] * len(first)  # "one" could start "one tw"
    assert step.piece == " two" and step.released == "" and not step.stopped
    assert detok.flush()[0] == "one"
