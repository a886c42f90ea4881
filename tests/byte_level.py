"""Single-byte token ids of a byte-level BPE tokenizer, to build prompts that end inside a UTF-8 character."""

from __future__ import annotations

from tokenizers import Tokenizer


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, token
    return found


def byte_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of ``text`` (every byte is a token of a byte-level BPE)."""
    alphabet = byte_level_alphabet()
    return [token_id(tokenizer, alphabet[b]) for b in text.encode()]
