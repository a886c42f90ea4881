"""Build small, deterministic, offline text-generation models for tests, examples and benchmarks.

Design note: no weights can be downloaded here, so every model rollserve tests against is a
random-initialised transformers config (fixed seed) with a byte-level BPE tokenizer trained locally on a
generated corpus, saved as safetensors and loaded back through the ordinary ``from_pretrained`` path.
The tokenizer carries a chat template so chat routes work.

    python -m handlers.synthetic_model OUT_DIR [--arch llama|qwen2|gpt2] [--size tiny|small|110m]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or have are not "
    "model server request token batch rolling dynamic cache block sequence prefill decode worker "
    "stream latency throughput queue memory attention layer weight vector matrix python torch "
    "deep learning language generate answer question hello world data time fast slow small large "
    "one two three four five six seven eight nine ten first last next step run stop start ready "
    "über café naïve résumé 東京 数据 模型 😀 🚀 ✓ — … “quoted” ‘single’"
).split()

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "inter": 128, "vocab": 512},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "inter": 688, "vocab": 1024},
    "110m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 12, "inter": 2048, "vocab": 8192},
}


def _corpus(seed: int, num_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(4, 20)
        words = [rng.choice(_WORDS) for _ in range(n)]
        punct = rng.choice([".", "!", "?", ",", ":", ";", ""])
        lines.append(" ".join(words).capitalize() + punct + rng.choice(["", " 42", " 3.14", " (x)", "\t"]))
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> int:
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    fast.save_pretrained(out_dir)
    return tok.get_vocab_size()


def build_model(out_dir: str | Path, arch: str = "llama", size: str = "small", seed: int = 0,
                max_position_embeddings: int = 2048) -> Path:
    """Write a tokenizer and a random-initialised model of ``arch``/``size`` to ``out_dir`` (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = SIZES[size]
    vocab = build_tokenizer(out, s["vocab"], seed)
    vocab_size = max(vocab, s["vocab"])
    common: dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                  dtype="float32")
    config = _config(arch, s, max_position_embeddings, common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Larger init than default so random logits are not near-uniform (more distinct greedy tokens).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.generation_config.pad_token_id = 2
    model.save_pretrained(out, safe_serialization=True)
    return out


def _config(arch: str, s: dict[str, int], max_pos: int, common: dict[str, Any]) -> Any:
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                           max_position_embeddings=max_pos, tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                           max_position_embeddings=max_pos, tie_word_embeddings=False, use_sliding_window=False,
                           **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"], n_positions=max_pos,
                          **common)
    raise ValueError(f"unknown arch {arch!r}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2", "gpt2"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = build_model(args.out_dir, args.arch, args.size, args.seed)
    print(json.dumps({"model_dir": str(out), "arch": args.arch, "size": args.size}))


if __name__ == "__main__":
    main()
