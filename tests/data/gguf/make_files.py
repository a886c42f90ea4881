"""Remake the small GGUF files the tests read: ``python tests/data/gguf/make_files.py`` in an environment with
``gguf`` and ``llama-cpp-python`` (llama.cpp's own quantizer writes the types the ``gguf`` package cannot).

A 2-layer Llama (hidden 256, so K-quant super-blocks of 256 fit every matrix; 4 heads of 64, 2 KV heads,
intermediate 256; seed 0) with a byte-level BPE vocabulary of 260 tokens (one merge) and a chat template, written
once as F32
by the ``gguf`` package, then quantized by llama.cpp to each type: ``tiny-<TYPE>.gguf``. llama.cpp picks the mix
of a type as it does for real models (Q4_K_M holds Q4_K and Q6_K tensors, Q3_K_M holds Q3_K, Q4_K and Q5_K, ...).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).parent
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 256, 2
# file suffix -> llama.cpp's LLAMA_FTYPE_MOSTLY_* value
FTYPES = {"F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
          "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (byte-level BPE's base vocabulary)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_llama(path: Path, hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS, ffn: int = FFN,
                layers: int = LAYERS, vocab: int = 0, half: bool = False, seed: int = 0) -> None:
    """A Llama GGUF file with random weights (normal, scaled per matrix; seed ``seed``), written tensor by tensor
    (a 7B layout never sits in memory whole); ``vocab`` pads the byte-level vocabulary with unused tokens; ``half``
    stores the matrices as F16."""
    rng = np.random.default_rng(seed)
    alphabet = _byte_alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*alphabet, alphabet[ord("t")] + alphabet[ord("h")]]
    tokens += [f"<unused{i}>" for i in range(max(0, vocab - len(tokens) - len(specials)))] + specials
    n_vocab, head_dim = len(tokens), hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random-llama")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1 if half else 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (n_vocab - 3) + [3, 3, 3])
    w.add_token_merges([f"{alphabet[ord('t')]} {alphabet[ord('h')]}"])
    w.add_bos_token_id(n_vocab - 2)
    w.add_eos_token_id(n_vocab - 1)
    w.add_chat_template(CHAT_TEMPLATE)
    plan: list[tuple[str, tuple[int, ...], float]] = [("token_embd.weight", (n_vocab, hidden), 1.0)]
    for i in range(layers):
        p = f"blk.{i}"
        plan += [(f"{p}.attn_norm.weight", (hidden,), 0.1), (f"{p}.attn_q.weight", (heads * head_dim, hidden), 0.08),
                 (f"{p}.attn_k.weight", (kv_heads * head_dim, hidden), 0.08),
                 (f"{p}.attn_v.weight", (kv_heads * head_dim, hidden), 0.08),
                 (f"{p}.attn_output.weight", (hidden, heads * head_dim), 0.05),
                 (f"{p}.ffn_norm.weight", (hidden,), 0.1),
                 (f"{p}.ffn_gate.weight", (ffn, hidden), 0.08), (f"{p}.ffn_up.weight", (ffn, hidden), 0.08),
                 (f"{p}.ffn_down.weight", (hidden, ffn), 0.05)]
    plan += [("output_norm.weight", (hidden,), 0.0), ("output.weight", (n_vocab, hidden), 0.08)]

    def dtype(shape: tuple[int, ...]) -> type:
        return np.float16 if half and len(shape) == 2 else np.float32

    for name, shape, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(dtype(shape)), int(np.prod(shape)) * np.dtype(dtype(shape)).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape, std in plan:
        if len(shape) == 1:  # norms: around one
            values = (1 + std * rng.standard_normal(shape)).astype(np.float32)
        else:
            values = (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype(shape))
        w.write_tensor_data(values)
    w.close()


def quantize(source: Path, dest: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), params)
    if rc != 0:
        sys.exit(f"llama.cpp's quantizer failed on {dest.name}: {rc}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "tiny-F32.gguf"
        write_llama(source)
        for name, ftype in FTYPES.items():
            quantize(source, HERE / f"tiny-{name}.gguf", ftype)
    for name in FTYPES:
        reader = gguf.GGUFReader(HERE / f"tiny-{name}.gguf")
        kinds = sorted({t.tensor_type.name for t in reader.tensors})
        print(f"tiny-{name}.gguf: {(HERE / f'tiny-{name}.gguf').stat().st_size} bytes, {', '.join(kinds)}")


if __name__ == "__main__":
    main()
