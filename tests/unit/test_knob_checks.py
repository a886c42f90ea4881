"""The knobs of a live model (``serving.models.knobs``): what ``PUT /models/{name}`` accepts, what it refuses and
how, and where an effective value came from."""

from __future__ import annotations

import pytest

from handlers.engine.planning.engine_config import EngineConfig
from rollcore.errors import InvalidRequest
from serving.config.model_config import model_config_keys
from serving.models import knobs
from tests.option_reads import Recording


def refused(items: list[tuple[str, str]]) -> str:
    with pytest.raises(InvalidRequest) as info:
        knobs.parse_query(items)
    return info.value.message


def test_every_knob_parses_with_its_minimum() -> None:
    items = [(k.name, str(k.minimum)) for k in knobs.KNOBS]
    assert knobs.parse_query(items) == {k.name: k.minimum for k in knobs.KNOBS}
    assert knobs.parse_query([("max_batch_delay", "0"), ("batch_size", "999999999")]) == {
        "max_batch_delay": 0, "batch_size": 999_999_999}


@pytest.mark.parametrize(("key", "value", "named"), [
    ("batch_size", "0", "batch_size must be an integer >= 1 (ASCII digits, at most 9), got '0'"),
    ("max_rolling_batch_size", "-4", "max_rolling_batch_size must be an integer >= 1"),
    ("max_batch_delay", "1.5", "max_batch_delay must be an integer >= 0"),
    ("job_queue_size", "1" * 10, "job_queue_size must be an integer >= 1 (ASCII digits, at most 9)"),
    ("min_worker", "\u00b2", "min_worker must be an integer >= 1"),
    ("max_worker", "", "max_worker must be an integer >= 1"),
    ("max_rolling_batch_prefill_tokens", " 8", "max_rolling_batch_prefill_tokens must be an integer >= 1"),
])
def test_a_bad_value_is_refused_naming_its_field(key: str, value: str, named: str) -> None:
    assert named in refused([(key, value)])


def test_every_bad_value_is_named_at_once() -> None:
    message = refused([("batch_size", "x"), ("max_batch_delay", "3"), ("max_worker", "0")])
    assert "batch_size must be" in message and "max_worker must be" in message and "max_batch_delay" not in message


@pytest.mark.parametrize(("key", "named"), [
    ("dtype", "'dtype' (option.dtype) cannot change on a live model: it needs a reload"),
    ("option.dtype", "'option.dtype' cannot change on a live model"),
    ("tensor_parallel_degree", "'tensor_parallel_degree' (option.tensor_parallel_degree) cannot change"),
    ("kv_cache_memory_mb", "'kv_cache_memory_mb' (option.kv_cache_memory_mb) cannot change"),
    ("num_kv_blocks", "'num_kv_blocks' (option.num_kv_blocks) cannot change"),
    ("option.rolling_batch", "'option.rolling_batch' cannot change"),
    ("max_idle_time", "'max_idle_time' cannot change"),
    ("option.my_handler_setting", "'option.my_handler_setting' (a handler option) cannot change"),
])
def test_a_key_that_needs_a_reload_is_refused_naming_it(key: str, named: str) -> None:
    message = refused([(key, "1")])
    assert named in message and "unregister and register the model, or restart the server" in message
    assert message.endswith(f"a live model changes: {knobs.names()}")


@pytest.mark.parametrize(("key", "named"), [
    ("bogus", "unknown parameter 'bogus'"),
    ("minWorkers", "unknown parameter 'minWorkers' (this API calls it min_worker)"),
    ("option.max_rolling_batch_size", "(this API calls it max_rolling_batch_size)"),
    ("Batch_Size", "'Batch_Size' (this API calls it batch_size)"),
])
def test_an_unknown_key_is_refused_naming_it(key: str, named: str) -> None:
    assert named in refused([(key, "2")])


def test_reload_and_unknown_keys_are_named_together_and_a_good_knob_beside_them_changes_nothing() -> None:
    message = refused([("batch_size", "4"), ("dtype", "bf16"), ("foo", "1"), ("block_size", "8")])
    assert "'dtype' (option.dtype), 'block_size' (option.block_size) cannot change on a live model: they need" \
        in message
    assert "unknown parameter 'foo'" in message


def test_empty_and_repeated() -> None:
    assert refused([]) == f"give at least one knob to change: {knobs.names()}"
    assert refused([("batch_size", "2"), ("batch_size", "3")]) == "query parameter 'batch_size' is given more than once"


def test_typed_values_are_checked_as_the_query() -> None:
    assert knobs.check_values({"max_rolling_batch_size": 4}) == {"max_rolling_batch_size": 4}
    with pytest.raises(InvalidRequest, match="batch_size must be an integer between 1 and 999999999, got 0"):
        knobs.check_values({"batch_size": 0})
    with pytest.raises(InvalidRequest, match="max_worker must be an integer between 1 and 999999999, got "
                                             "1000000000"):
        knobs.check_values({"max_worker": 1_000_000_000})
    with pytest.raises(InvalidRequest, match="give at least one knob"):
        knobs.check_values({})


@pytest.mark.parametrize(("source", "kind"), [
    ("default", "default"), ("serving.properties:3", "file"), ("env SERVING_BATCH_SIZE", "env"),
    ("env OPTION_MAX_ROLLING_BATCH_SIZE", "env"), ("API", "API"), ("override", "API"),
    ("server config (config.properties:2)", "file"), ("server config (env SERVING_JOB_QUEUE_SIZE)", "env"),
    ("server config (default)", "default"),
])
def test_source_kind(source: str, kind: str) -> None:
    assert knobs.source_kind(source) == kind


def test_every_engine_option_is_a_knob_or_needs_a_reload() -> None:
    options = Recording()
    EngineConfig.from_options(options)
    assert options.read  # the engine reads its options through get()
    knob_keys = {"max_rolling_batch_size", "max_rolling_batch_prefill_tokens", "max_itl_ms"}
    for key in sorted(options.read - knob_keys):
        assert "cannot change on a live model" in refused([(key, "1")]), key
    for key in knob_keys:
        assert knobs.parse_query([(key, "1")]) == {key: 1}


def test_every_model_key_is_a_knob_or_needs_a_reload() -> None:
    spelled = {k.key: k.name for k in knobs.KNOBS}
    for key in model_config_keys():
        if key in spelled:
            assert key == spelled[key] or f"this API calls it {spelled[key]}" in refused([(key, "1")]), key
        else:
            assert "cannot change on a live model" in refused([(key, "1")]), key
