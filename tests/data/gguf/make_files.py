"""Remake the small GGUF files the tests read: ``python tests/data/gguf/make_files.py`` in an environment with
``gguf`` and ``llama-cpp-python`` (llama.cpp's own quantizer writes the types the ``gguf`` package cannot).

A 2-layer Llama (hidden 256, so K-quant super-blocks of 256 fit every matrix; 4 heads of 64, 2 KV heads,
intermediate 256; seed 0) with a byte-level BPE vocabulary of 260 tokens (one merge) and a chat template, written once as F32
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


def write_f32(path: Path) -> None:
    rng = np.random.default_rng(0)
    alphabet = _byte_alphabet()
    tokens = [*alphabet, alphabet[ord("t")] + alphabet[ord("h")], "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3, 3, 3])
    w.add_token_merges([f"{alphabet[ord('t')]} {alphabet[ord('h')]}"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template(CHAT_TEMPLATE)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    head_dim = HIDDEN // HEADS
    w.add_tensor("token_embd.weight", mat(vocab, HIDDEN, 1.0))
    for i in range(LAYERS):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(f"{p}.attn_q.weight", mat(HEADS * head_dim, HIDDEN, 0.08))
        w.add_tensor(f"{p}.attn_k.weight", mat(KV_HEADS * head_dim, HIDDEN, 0.08))
        w.add_tensor(f"{p}.attn_v.weight", mat(KV_HEADS * head_dim, HIDDEN, 0.08))
        w.add_tensor(f"{p}.attn_output.weight", mat(HIDDEN, HEADS * head_dim, 0.05))
        w.add_tensor(f"{p}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", mat(FFN, HIDDEN, 0.08))
        w.add_tensor(f"{p}.ffn_up.weight", mat(FFN, HIDDEN, 0.08))
        w.add_tensor(f"{p}.ffn_down.weight", mat(HIDDEN, FFN, 0.05))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output.weight", mat(vocab, HIDDEN, 0.08))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
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
        write_f32(source)
        for name, ftype in FTYPES.items():
            quantize(source, HERE / f"tiny-{name}.gguf", ftype)
    for name in FTYPES:
        reader = gguf.GGUFReader(HERE / f"tiny-{name}.gguf")
        kinds = sorted({t.tensor_type.name for t in reader.tensors})
        print(f"tiny-{name}.gguf: {(HERE / f'tiny-{name}.gguf').stat().st_size} bytes, {', '.join(kinds)}")


if __name__ == "__main__":
    main()
