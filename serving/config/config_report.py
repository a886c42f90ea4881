"""``serving config``'s table: one ``key = value  (source)`` line per setting of a model's effective
configuration, grouped by who reads it, then the batching and layout decisions and the warnings."""

from __future__ import annotations

from rollcore.options import handlers_of
from serving.config.keys import MODEL_KEYS
from serving.config.model_config import OPTION_SPECS, ModelConfig

_HANDLER_TITLES = {"engine": "the rolling engine (handlers/engine)", "huggingface": "the huggingface handler "
                   "(dynamic batching, HF generate)", "echo": "the echo handler"}


def describe_model_config(cfg: ModelConfig) -> str:
    """A human-readable table, one ``key = value  (source)`` line per setting, for ``serving config``: the
    model keys and the options the frontend reads, the options of the handler the model runs (from the
    schema, ``rollcore.options``, defaults included), the other options (the handler's own, as set), the
    batching decision, and a ``warning:`` line per unknown option that looks like a typo of a known one."""
    props = cfg.handler_properties()
    runs = handlers_of(cfg.entry_point, cfg.batching.rolling)
    options = sorted(key for key in cfg.sources if key.startswith("option."))
    mine = [key for key in options if key in OPTION_SPECS and OPTION_SPECS[key].readers & runs]
    theirs = [key for key in options if key not in OPTION_SPECS]
    general = [key for key in options if key not in mine and key not in theirs]
    sections = [(f"model {cfg.name}  ({cfg.model_dir})",
                 [key for key in MODEL_KEYS if key in cfg.sources] + general)]
    sections.append((f"options of {' and '.join(_HANDLER_TITLES[reader] for reader in sorted(runs))}", mine))
    sections.append(("other options (not read by rollserve: passed to the handler as set)", theirs))

    def value(key: str) -> str:
        return cfg.options[key[len("option."):]] if key.startswith("option.") else props[key]

    rows = [(key, value(key), cfg.sources[key]) for _, keys in sections for key in keys]
    width = max(len(f"{key} = {text}") for key, text, _ in rows)
    lines: list[str] = []
    for title, keys in sections:
        if keys:
            lines.append(title)
            lines += [f"  {f'{key} = {value(key)}':<{width}}  ({cfg.sources[key]})" for key in keys]
    b = cfg.batching
    lines.append(f"effective rolling_batch = {b.rolling_batch}  "
                 f"({'rolling' if b.rolling else 'dynamic'} batching; requested {b.rolling_batch_requested})")
    lines.append(f"  reason: {b.rolling_batch_reason}")
    if cfg.layout_reason:
        lines.append(f"effective workers = {cfg.min_workers}-{cfg.max_workers}  ({cfg.layout_reason})")
    lines += [f"warning: {warning}" for warning in cfg.warnings]
    return "\n".join(lines) + "\n"
