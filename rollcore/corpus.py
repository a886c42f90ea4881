"""The words the locally built test models' tokenizers are trained on (``handlers.synthetic_model``), which
the benchmark workloads draw prompts from, so every such tokenizer encodes them."""

from __future__ import annotations

WORDS: tuple[str, ...] = tuple((
    "the a an of to and in is it that for on with as was by at be this from or have are not "
    "model server request token batch rolling dynamic cache block sequence prefill decode worker "
    "stream latency throughput queue memory attention layer weight vector matrix python torch "
    "deep learning language generate answer question hello world data time fast slow small large "
    "one two three four five six seven eight nine ten first last next step run stop start ready "
    "über café naïve résumé 東京 数据 模型 😀 🚀 ✓ — … “quoted” ‘single’"
).split())
