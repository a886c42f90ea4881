"""Build (or locate) the models the benchmark runs on.

    python benchmarks/build_models.py            # builds benchmarks/models/llama-110m if missing
    python benchmarks/build_models.py --force    # rebuilds it

Models (``--model`` names of ``bench.py``):
  default  the small test model, ``examples/models/tiny-llama`` (random Llama, shipped in the repo)
  110m     a ~110M-parameter random Llama (hidden 768, 12 layers, 12 heads, vocab 8192), built here with
           ``handlers.synthetic_model.build_model(out, arch="llama", size="110m")`` into
           ``benchmarks/models/llama-110m`` (git-ignored: weights are never committed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODELS_DIR = HERE / "models"
DEFAULT_MODEL = REPO / "examples" / "models" / "tiny-llama"
LLAMA_110M = MODELS_DIR / "llama-110m"


# The 110m folder's own configuration, as a user would drop it in (what serving tune and tune_quality.py start
# from; bench.py and compare.py write their own): rolling batching, one worker with every core's threads.
PROPERTIES_110M = """engine=Python
option.entryPoint=huggingface
option.dtype=fp32
option.rolling_batch=auto
option.max_rolling_batch_size=32
option.max_rolling_batch_prefill_tokens=2048
option.num_threads=auto
minWorkers=1
maxWorkers=1
"""


def build_110m(force: bool = False) -> Path:
    """Build the 110M Llama once (seeded, deterministic), with its serving.properties; returns its folder."""
    if not ((LLAMA_110M / "model.safetensors").exists() and (LLAMA_110M / "tokenizer.json").exists()) or force:
        from handlers.synthetic_model import build_model

        build_model(LLAMA_110M, arch="llama", size="110m")
    props = LLAMA_110M / "serving.properties"
    if not props.exists() or force:
        props.write_text(PROPERTIES_110M)
    return LLAMA_110M


def model_dir(name: str) -> Path:
    """Folder of the model called ``name`` (``default`` or ``110m``), building it if needed."""
    if name == "default":
        return DEFAULT_MODEL
    if name == "110m":
        return build_110m()
    raise ValueError(f"unknown model {name!r} (default, 110m)")


def count_parameters(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            total += _prod(f.get_slice(key).get_shape())
    return total


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild the 110m model even if it exists")
    args = ap.parse_args(argv)
    out = build_110m(force=args.force)
    print(json.dumps({"110m": str(out), "parameters": count_parameters(out),
                      "default": str(DEFAULT_MODEL), "default_parameters": count_parameters(DEFAULT_MODEL)}))


if __name__ == "__main__":
    main()
