"""Build small, deterministic, offline text-generation models for tests, examples and benchmarks.

Design note: no weights can be downloaded here, so every model rollserve tests against is a
random-initialised transformers config (fixed seed) with a byte-level BPE tokenizer trained locally on a
generated corpus, saved as safetensors and loaded back through the ordinary ``from_pretrained`` path.
The tokenizer carries a chat template so chat routes work.

    python -m handlers.synthetic_model OUT_DIR [--arch FAMILY] [--size tiny|small|110m]
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollcore.corpus import WORDS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
        words = [rng.choice(WORDS) for _ in range(n)]
        punct = rng.choice([".", "!", "?", ",", ":", ";", ""])
        lines.append(" ".join(words).capitalize() + punct + rng.choice(["", " 42", " 3.14", " (x)", "\t"]))
    return lines


_TRAINED: dict[tuple[int, int], tuple[Path, int]] = {}  # (size asked, seed) -> its saved files and its size


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> int:
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer; returns its size. Training is
    deterministic and most of a tiny model's build, so a process trains each (size, seed) once and copies it after."""
    if (vocab_size, seed) not in _TRAINED:
        saved = Path(tempfile.mkdtemp(prefix="rollserve-tokenizer-"))
        atexit.register(shutil.rmtree, saved, True)
        _TRAINED[(vocab_size, seed)] = saved, _train_tokenizer(saved, vocab_size, seed)
    saved, size = _TRAINED[(vocab_size, seed)]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for f in saved.iterdir():
        shutil.copyfile(f, Path(out_dir) / f.name)
    return size


def _train_tokenizer(out_dir: Path, vocab_size: int, seed: int) -> int:
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


# Sliding window of the family matrix's models: small, so that prompts and outputs cross it.
TEST_SLIDING_WINDOW = 16


def _config(arch: str, s: dict[str, int], max_pos: int, common: dict[str, Any]) -> Any:
    """A transformers config of family ``arch`` (see ``FAMILIES``) at size ``s``."""
    from transformers import AutoConfig

    families = {**FAMILIES, **UNLISTED_FAMILIES}
    if arch not in families:
        raise ValueError(f"unknown arch {arch!r}; one of {', '.join(sorted(families))}")
    model_type, extra = families[arch](s, max_pos)
    return AutoConfig.for_model(model_type, **{**common, **extra})


def _llama_like(s: dict[str, int], max_pos: int, **extra: Any) -> dict[str, Any]:
    return dict(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=max_pos,
                tie_word_embeddings=False, **extra)


def _alternating(s: dict[str, int], first: str = "sliding_attention") -> list[str]:
    other = "full_attention" if first == "sliding_attention" else "sliding_attention"
    return [first if i % 2 == 0 else other for i in range(s["layers"])]


_W = TEST_SLIDING_WINDOW
_Family = Any  # Callable[[dict[str, int], int], tuple[str, dict[str, Any]]]
# name -> (model_type, config kwargs). Windows and soft-caps are small enough to matter in short tests.
FAMILIES: dict[str, _Family] = {
    "llama": lambda s, m: ("llama", _llama_like(s, m)),
    "mistral": lambda s, m: ("mistral", _llama_like(s, m, sliding_window=_W)),
    "qwen2": lambda s, m: ("qwen2", _llama_like(s, m, use_sliding_window=False)),
    "qwen2-swa": lambda s, m: ("qwen2", _llama_like(s, m, use_sliding_window=True, sliding_window=_W,
                                                    max_window_layers=1)),
    "qwen3": lambda s, m: ("qwen3", _llama_like(s, m, head_dim=s["hidden"] // s["heads"])),
    "gemma": lambda s, m: ("gemma", _llama_like(s, m, head_dim=s["hidden"] // s["heads"])),
    "gemma2": lambda s, m: ("gemma2", _llama_like(
        s, m, head_dim=s["hidden"] // s["heads"], sliding_window=_W, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, query_pre_attn_scalar=s["hidden"] // s["heads"],
        layer_types=_alternating(s))),
    "gemma3": lambda s, m: ("gemma3_text", _llama_like(
        s, m, head_dim=s["hidden"] // s["heads"], sliding_window=_W, query_pre_attn_scalar=s["hidden"] // s["heads"],
        layer_types=_alternating(s))),
    "phi3": lambda s, m: ("phi3", _llama_like(s, m, sliding_window=_W)),
    "starcoder2": lambda s, m: ("starcoder2", _llama_like(s, m, sliding_window=_W)),
    "mixtral": lambda s, m: ("mixtral", _llama_like(s, m, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda s, m: ("qwen2_moe", _llama_like(
        s, m, moe_intermediate_size=s["inter"] // 2, shared_expert_intermediate_size=s["inter"], num_experts=4,
        num_experts_per_tok=2, use_sliding_window=False)),
    "qwen3_moe": lambda s, m: ("qwen3_moe", _llama_like(
        s, m, head_dim=s["hidden"] // s["heads"], moe_intermediate_size=s["inter"] // 2, num_experts=4,
        num_experts_per_tok=2)),
    "olmo": lambda s, m: ("olmo", _llama_like(s, m)),
    "olmo2": lambda s, m: ("olmo2", _llama_like(s, m)),
    "gpt_oss": lambda s, m: ("gpt_oss", _llama_like(
        s, m, head_dim=s["hidden"] // s["heads"], sliding_window=_W, num_local_experts=4, num_experts_per_tok=2,
        layer_types=_alternating(s), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "cohere": lambda s, m: ("cohere", _llama_like(s, m)),
    "granite": lambda s, m: ("granite", _llama_like(s, m)),
    "stablelm": lambda s, m: ("stablelm", _llama_like(s, m)),
    "phi": lambda s, m: ("phi", _llama_like(s, m)),
    "gpt2": lambda s, m: ("gpt2", dict(n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"], n_positions=m)),
    "gpt_neox": lambda s, m: ("gpt_neox", dict(
        hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], max_position_embeddings=m, tie_word_embeddings=False)),
    # Falcon-7B layout: one shared K/V head (multi-query), parallel attention + MLP, rotary.
    "falcon-7b": lambda s, m: ("falcon", dict(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"], multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False, max_position_embeddings=m)),
    # Falcon-40B/180B layout: grouped K/V heads interleaved with their queries, two layer norms.
    "falcon-40b": lambda s, m: ("falcon", dict(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_kv_heads=s["kv_heads"], new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False,
        max_position_embeddings=m)),
    # Falcon-RW layout: sequential attention and MLP, separate Q/K/V heads, biases.
    "falcon-rw": lambda s, m: ("falcon", dict(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"], multi_query=False,
        new_decoder_architecture=False, parallel_attn=False, bias=True, alibi=False, max_position_embeddings=m)),
    "falcon-alibi": lambda s, m: ("falcon", dict(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"], multi_query=False,
        new_decoder_architecture=False, parallel_attn=False, bias=True, alibi=True, max_position_embeddings=m)),
    "bloom": lambda s, m: ("bloom", dict(hidden_size=s["hidden"], n_layer=s["layers"], n_head=s["heads"])),
    "mpt": lambda s, m: ("mpt", dict(d_model=s["hidden"], n_layers=s["layers"], n_heads=s["heads"],
                                     max_seq_len=m, expansion_ratio=2)),
}

# Architectures off the engine's verified list (``handlers.engine.planning.families.SUPPORTED``) that transformers
# serves through its attention interface: the engine admits them by its load-time self-check (tests/engine/
# test_self_check.py). OLMo-3 alternates sliding and full layers; GLM-4 has partial rotary and extra norms.
UNLISTED_FAMILIES: dict[str, _Family] = {
    "olmo3": lambda s, m: ("olmo3", _llama_like(s, m, sliding_window=_W, layer_types=_alternating(s))),
    "glm4": lambda s, m: ("glm4", _llama_like(s, m, head_dim=s["hidden"] // s["heads"])),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=sorted({**FAMILIES, **UNLISTED_FAMILIES}))
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = build_model(args.out_dir, args.arch, args.size, args.seed)
    print(json.dumps({"model_dir": str(out), "arch": args.arch, "size": args.size}))


if __name__ == "__main__":
    main()
