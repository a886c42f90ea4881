"""The one option schema (``rollcore.options``) and its value parsers (``rollcore.values``): the frontend's
config and the handlers parse an option alike, every option a built-in handler reads is in the schema, and
an unknown ``option.*`` key that looks like a typo of a known one is a warning (never an error)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from handlers.base import option_bool
from handlers.engine.planning.engine_config import EngineConfig
from rollcore.errors import ConfigError
from rollcore.options import ENGINE, OPTIONS, suggest
from rollcore.values import BOOL_WORDS, FALSE_WORDS, TRUE_WORDS, boolean, choice, integer, number, render
from serving.config.config_report import describe_model_config
from serving.config.model_config import load_model_config, model_config_keys
from serving.config.server_config import load_server_config
from tests.option_reads import Recording

ROOT = Path(__file__).resolve().parents[2]


def model(tmp_path: Path, properties: str, name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "serving.properties").write_text(properties, encoding="utf-8")
    return folder


def engine_reads() -> set[str]:
    options = Recording()
    EngineConfig.from_options(options)
    return options.read


# --- value parsers ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("parser", "text", "value"), [
    (integer(1), "7", 7), (integer(0, 9), "9", 9), (integer(0, auto=True), "AUTO", "auto"),
    (integer(0, auto=True), "0", 0), (number(0, 1, exclusive=True), "1", 1.0), (number(0), "0", 0.0),
    (boolean, "Yes", True), (boolean, "OFF", False),
    (choice(("fp32", "bf16"), {"bfloat16": "bf16"}), "BFloat16", "bf16"),
    (choice(("Python", "MPI")), "python", "Python"),
])
def test_parsers_accept(parser: Any, text: str, value: object) -> None:
    assert parser(text) == value


@pytest.mark.parametrize(("parser", "text", "reason"), [
    (integer(1), "0", "expected an integer >= 1"), (integer(1), "1.5", "expected an integer >= 1"),
    (integer(0, 9), "10", "expected an integer >= 0 and <= 9"), (integer(1, auto=True), "x", ">= 1 or auto"),
    (number(0, 1, exclusive=True), "0", "expected a number > 0 and <= 1"),
    (number(0, 1, exclusive=True), "1.01", "expected a number > 0 and <= 1"),
    (number(0), "nan", "expected a number >= 0"), (number(0), "inf", "expected a number >= 0"),
    (boolean, "maybe", "expected true or false"), (boolean, "", "expected true or false"),
    (choice(("a", "b")), "c", "expected one of a, b"),
])
def test_parsers_refuse_naming_what_they_expect(parser: Any, text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parser(text)


def test_render_is_what_the_parser_reads_back() -> None:
    for spec in OPTIONS.values():
        if spec.default is not None:
            value = spec.parser(spec.default)
            assert spec.parser(render(value)) == value, spec.key


# --- one set of boolean words -----------------------------------------------------------------------

@pytest.mark.parametrize("word", [*TRUE_WORDS, *FALSE_WORDS, "TRUE", "Off", "YES"])
def test_boolean_words_are_the_same_in_the_config_the_engine_and_the_handlers(tmp_path: Path, word: str) -> None:
    expected = BOOL_WORDS[word.lower()]
    cfg = load_model_config(model(tmp_path, f"option.rolling_batch=auto\noption.enable_prefix_caching={word}\n"
                                            f"option.trust_remote_code={word}\n"))
    assert cfg.trust_remote_code is expected
    assert cfg.options["enable_prefix_caching"] == ("true" if expected else "false")  # what the worker gets
    assert EngineConfig.from_options({"enable_prefix_caching": word}).enable_prefix_caching is expected
    assert EngineConfig.from_options({"trust_remote_code": word}).trust_remote_code is expected
    assert load_server_config(None, overrides={"enable_model_api": word}).enable_model_api is expected
    assert option_bool(word) is expected


def test_a_bad_boolean_is_refused_alike_in_the_config_and_the_engine(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as frontend:
        load_model_config(model(tmp_path, "option.rolling_batch=auto\noption.enable_prefix_caching=maybe\n"))
    with pytest.raises(ConfigError) as engine:
        EngineConfig.from_options({"enable_prefix_caching": "maybe"})
    assert str(frontend.value).endswith(": option.enable_prefix_caching = 'maybe': expected true or false "
                                        "(or 1/0, yes/no, on/off)")
    assert str(engine.value) == ("option.enable_prefix_caching = 'maybe': expected true or false "
                                 "(or 1/0, yes/no, on/off)")


# --- every option a built-in handler reads is in the schema -----------------------------------------

def test_every_option_the_engine_reads_is_in_the_schema_and_back() -> None:
    read = engine_reads()
    assert read - set(OPTIONS) == set()
    assert all(ENGINE in OPTIONS[key].readers for key in read)
    # ...and the schema names no engine option that EngineConfig ignores (model_id: where the loader looks;
    # origin_model_id: where a follower host fetches the same weights)
    assert {key for key, spec in OPTIONS.items() if ENGINE in spec.readers} - read == {"model_id", "origin_model_id"}


def test_engine_defaults_are_the_schemas() -> None:
    assert EngineConfig.from_options({}) == EngineConfig.from_options(
        {key: spec.default for key, spec in OPTIONS.items() if ENGINE in spec.readers and spec.default is not None})


_READERS = {"option", "option_value", "parse_option", "model_option"}


def option_reads(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, key)`` of each option read with a literal key: ``ctx.option("k")``, ``option_value(m, "k")``,
    ``parse_option("k", ...)``, ``model_option(ep, "k")`` and ``<...>options.get("k")``/``properties.get("k")``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        if name in _READERS or (name == "get" and receiver.endswith(("options", "properties"))):
            keys = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if keys:
                yield node.lineno, keys[0]


def test_every_option_a_built_in_handler_or_the_frontend_reads_is_in_the_schema() -> None:
    model_keys = set(model_config_keys())
    files = [p for package in ("handlers", "serving") for p in sorted((ROOT / package).rglob("*.py"))]
    found = {(str(p.relative_to(ROOT)), line, key) for p in files for line, key in option_reads(p)}
    assert len(found) > 15  # the reader sees the reads (ctx.option, options.get, option_value, ...)
    unknown = sorted(f"{path}:{line}: {key}" for path, line, key in found
                     if key not in OPTIONS and key not in model_keys)
    assert unknown == []


def test_the_reader_finds_a_read_of_an_unknown_option(tmp_path: Path) -> None:
    """The check above can fail."""
    source = tmp_path / "h.py"
    source.write_text("def initialize(ctx):\n    return ctx.option('lora_rank'), ctx.properties.get('x')\n")
    assert sorted(option_reads(source)) == [(2, "lora_rank"), (2, "x")]


# --- validation at load, for the handler that reads the option ---------------------------------------

@pytest.mark.parametrize(("entry", "line", "message"), [
    ("huggingface", "option.block_size=0", "option.block_size = '0': expected an integer >= 1"),
    ("rolling", "option.kv_cache_memory_fraction=2", "option.kv_cache_memory_fraction = '2': expected a number > 0"),
    ("huggingface", "option.num_threads=many", "option.num_threads = 'many': expected an integer >= 1 or auto"),
    ("echo", "option.echo_delay_ms=-1", "option.echo_delay_ms = '-1': expected a number >= 0"),
])
def test_a_built_in_handlers_bad_option_fails_at_load_with_file_and_line(tmp_path: Path, entry: str, line: str,
                                                                          message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_model_config(model(tmp_path, f"option.entryPoint={entry}\n{line}\n"))
    assert f"serving.properties:2: {message}" in str(info.value)


def test_a_custom_handler_keeps_its_own_meaning_of_an_engine_key(tmp_path: Path) -> None:
    cfg = load_model_config(model(tmp_path, "option.entryPoint=model.py\noption.block_size=big\n"))
    assert cfg.options["block_size"] == "big" and cfg.warnings == ()
    assert "kv_cache_memory_mb" not in cfg.options  # no engine defaults for a handler that is not the engine


def test_the_engine_defaults_reach_a_rolling_models_config_and_sources(tmp_path: Path) -> None:
    cfg = load_model_config(model(tmp_path, "option.rolling_batch=auto\noption.block_size=8\n"),
                            env={"OPTION_KV_CACHE_MEMORY_MB": "AUTO"})
    assert (cfg.options["block_size"], cfg.sources["option.block_size"]) == ("8", "serving.properties:2")
    assert (cfg.options["kv_cache_memory_mb"], cfg.sources["option.kv_cache_memory_mb"]) == (
        "auto", "env OPTION_KV_CACHE_MEMORY_MB")
    assert (cfg.options["num_kv_blocks"], cfg.sources["option.num_kv_blocks"]) == ("0", "default")
    assert EngineConfig.from_options(cfg.handler_properties()) == EngineConfig.from_options({"block_size": "8"})
    text = describe_model_config(cfg)
    assert "options of the rolling engine" in text
    assert any(ln.strip().startswith("option.seed = 0") and ln.endswith("(default)") for ln in text.splitlines())


# --- did you mean -------------------------------------------------------------------------------------

TYPO = "unknown option.max_rolling_bach_size: did you mean option.max_rolling_batch_size?"


@pytest.mark.parametrize(("text", "env", "overrides", "source"), [
    ("option.max_rolling_bach_size=8\n", {}, {}, "serving.properties:1"),
    ("", {"OPTION_MAX_ROLLING_BACH_SIZE": "8"}, {}, "env OPTION_MAX_ROLLING_BACH_SIZE"),
    ("", {}, {"option.max_rolling_bach_size": "8"}, "override"),
])
def test_an_option_close_to_a_known_one_is_a_warning(tmp_path: Path, text: str, env: dict[str, str],
                                                      overrides: dict[str, str], source: str) -> None:
    cfg = load_model_config(model(tmp_path, text), env=env, overrides=overrides)
    assert cfg.warnings == (f"{TYPO} ({source})",)
    assert cfg.options["max_rolling_bach_size"] == "8"  # still passed on: a warning, never an error
    assert cfg.batching.max_rolling_batch_size == 32
    assert f"warning: {TYPO} ({source})" in describe_model_config(cfg).splitlines()


@pytest.mark.parametrize("key", sorted(engine_reads()))
def test_a_typo_of_any_engine_option_is_caught(tmp_path: Path, key: str) -> None:
    middle = next(i for i in range(len(key) // 2, len(key)) if key[i] != "_")
    typo = key[:middle] + key[middle + 1:]  # one letter dropped (not a '_': keys match ignoring those)
    cfg = load_model_config(model(tmp_path, f"option.entryPoint=model.py\noption.{typo}=1\n"))
    assert cfg.warnings == (f"unknown option.{typo}: did you mean option.{key}? (serving.properties:2)",)


@pytest.mark.parametrize("line", ["option.my_handler_thing=1", "option.greeting=hi", "option.custom_Camel=x",
                                  "option.max_rolling_batch_size=4", "option.MAX_ROLLING_BATCH_SIZE=4"])
def test_a_custom_or_known_option_gives_no_warning(tmp_path: Path, line: str) -> None:
    cfg = load_model_config(model(tmp_path, f"option.entryPoint=model.py\n{line}\n"))
    assert cfg.warnings == ()
    assert "warning:" not in describe_model_config(cfg)


def test_suggest_is_case_insensitive_and_keeps_the_schemas_spelling() -> None:
    assert suggest("ENTRYPOINTS") == "entryPoint"
    assert suggest("my_handler_thing") is None
