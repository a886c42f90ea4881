"""Counts text encodings in every process of a test server (frontend and workers): on ``PYTHONPATH`` with
``ROLLSERVE_TEST_ENCODE_LOG`` set, each call of the ``tokenizers`` package's encoders (which transformers' fast
tokenizers call as well) appends one line ``PID TEXTS PROBES`` to that file: how many texts it encoded, and how
many of them were the tokenizer probe (``rollcore.tokenizer_probe``)."""

from __future__ import annotations

import os

LOG = os.environ.get("ROLLSERVE_TEST_ENCODE_LOG")

if LOG:
    import tokenizers

    from rollcore.tokenizer_probe import TOKENIZER_PROBE

    def _counting(name: str):  # type: ignore[no-untyped-def]
        original = getattr(tokenizers.Tokenizer, name)

        def encode(self, first, *args, **kwargs):  # type: ignore[no-untyped-def]
            texts = [first] if name == "encode" else list(first)
            line = f"{os.getpid()} {len(texts)} {sum(t == TOKENIZER_PROBE for t in texts)}\n"
            fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
            return original(self, first, *args, **kwargs)
        return encode

    for _name in ("encode", "encode_batch", "encode_batch_fast"):
        if hasattr(tokenizers.Tokenizer, _name):
            setattr(tokenizers.Tokenizer, _name, _counting(_name))
