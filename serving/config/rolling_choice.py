"""Which batching a model gets: ``option.rolling_batch`` resolved to the rolling engine or dynamic batching.

Design note: ``option.rolling_batch`` is resolved once, when the model's configuration is read
(``serving.config.model_config``), to the batching the model gets (``BatchingConfig``: ``rolling_batch`` is the
effective
``scheduler`` or ``disable``, with the requested value and the reason), so the frontend builds the right batcher
before any worker starts. ``auto`` picks the rolling engine when the model folder's ``config.json`` names an
architecture the engine serves exactly and dynamic batching (HF ``generate``) otherwise; ``scheduler`` -- and
DJL's ``lmi-dist`` and ``vllm``, which name rollserve's engine here -- on an architecture the engine refuses is a
``ConfigError`` naming the architecture and the feature. The check is ``handlers.engine.planning.families``,
torch-free like this module.
"""

from __future__ import annotations

from pathlib import Path

from rollcore.model_folder import weights_folder
from rollcore.options import ROLLING_ENGINE_ALIASES
from serving.config.settings import Setting, fail

# Entry points that run the built-in engine when rolling (the endpoint maps them to ``rolling``).
ENGINE_ENTRY_POINTS = frozenset({"huggingface", "djl_python.huggingface", "rolling"})


def embedding_encoder(requested: str, setting: Setting, folder: Path, effective: str, reason: str
                      ) -> tuple[str, str]:
    """``option.task=embedding`` on an encoder (BERT and kin): dynamic batching's ``AutoModel`` handler embeds with
    it, the rolling engine runs decoders only. auto falls back to dynamic batching; an explicit rolling engine fails
    the model by name. A decoder, or a folder without ``config.json``, keeps the choice made."""
    from handlers.preflight import engine_admission  # torch-free

    if not (folder / "config.json").is_file():
        return effective, reason
    config = engine_admission(folder, None)[0]
    archs = [str(a) for a in config.get("architectures") or ()]
    if config.get("is_decoder") or any(a.endswith("ForCausalLM") for a in archs):
        return effective, reason
    named = f"{archs[0] if archs else 'the model'} (model_type={config.get('model_type')})"
    why = (f"option.task=embedding: {named} is an encoder, which the rolling engine does not run (it runs "
           "decoders); dynamic batching serves its embeddings")
    if requested == "auto":
        return "disable", f"option.rolling_batch=auto: dynamic batching; {why}"
    raise fail("option.rolling_batch", setting, f"{why}: set option.rolling_batch=disable (or auto)")


def choose_rolling_batch(requested: str, setting: Setting, entry_point: str, model_dir: Path,
                         model_id: str | None, max_model_len: int | None) -> tuple[str, str]:
    """``(effective, reason)`` for ``option.rolling_batch``: ``scheduler`` or ``disable``.

    Only the built-in engine's entry points are checked against the architecture; a custom entry point
    (``model.py``, a module) keeps rolling batching as requested, its handler being the engine. Raises
    ``ConfigError`` when an explicit rolling engine is asked for an architecture the engine refuses."""
    if requested == "disable":
        return "disable", "option.rolling_batch=disable: dynamic batching"
    asked = f"option.rolling_batch={requested}" + (
        " (DJL's name, served by rollserve's rolling engine)" if requested in ROLLING_ENGINE_ALIASES else "")
    if entry_point not in ENGINE_ENTRY_POINTS:
        return "scheduler", (f"{asked}: rolling batching with the handler of entry point {entry_point!r} "
                             "(not the built-in engine, so the architecture is not checked)")
    folder = weights_folder(model_dir, model_id)
    if not (folder / "config.json").is_file():
        return "scheduler", (f"{asked}: rolling engine; no config.json in the model folder to check the "
                             "architecture before loading (the engine checks it when it loads)")
    from handlers.preflight import engine_admission  # torch-free

    config, reason, verified = engine_admission(folder, max_model_len)
    if reason is None:
        archs = config.get("architectures")
        arch = str(archs[0]) if isinstance(archs, list) and archs else str(config.get("model_type"))
        named = f"{arch} (model_type={config.get('model_type')})"
        if verified:
            return "scheduler", f"{asked}: rolling engine; {named} is supported"
        # Off the verified list: the worker's self-check decides at load, and a difference FAILS the model
        # (it is not switched to dynamic batching behind the user's back: docs/configuration.md, "Model families").
        return "scheduler", (f"{asked}: rolling engine, pending load-time self-check; {named} is not on the "
                             "verified list: the worker compares the engine's logits with transformers' forward "
                             "when it loads and fails the model on a difference (option.rolling_batch=disable "
                             "serves it with dynamic batching)")
    if requested == "auto" and entry_point != "rolling":
        return "disable", (f"{asked}: dynamic batching (HF generate); the rolling engine cannot serve this "
                           f"model: {reason}")
    raise fail("option.rolling_batch", setting,
                f"the rolling engine cannot serve this model: {reason}; set option.rolling_batch=auto (falls back "
                "to dynamic batching) or disable")
