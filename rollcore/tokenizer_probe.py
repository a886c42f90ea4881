"""The text both processes tokenize once per load, so the frontend knows its token ids are the worker's.

Design note: the frontend tokenizes a text prompt for its length check with the model folder's
``tokenizer.json`` (the ``tokenizers`` package); the worker's handler loads the same folder through
transformers. They agree for ordinary checkpoints, but a tokenizer_config.json option that transformers
applies on top (BOS/EOS adding, prefix spaces) or a remote-code tokenizer can make them differ. A worker
reports the ids of ``TOKENIZER_PROBE`` in its ``describe()`` (``tokenizer_probe``); the frontend sends its
own ids with a request only when it encodes the probe to the same list, else the text, which the worker
tokenizes as before.
"""

from __future__ import annotations

# leading and doubled spaces, a newline and a tab, digits, punctuation, accents, CJK and an emoji: the places
# where pre-tokenizers, normalizers and special-token rules differ
TOKENIZER_PROBE = " Hello,  world!\n\tThe year 2024: naïve café, 東京 🙂 <s></s> end."
