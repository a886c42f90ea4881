"""Prefix- and session-aware routing: the router's choice, the engine's key reports it reads, the batcher using it."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from handlers.engine.core.scheduler import Scheduler, SchedulerConfig
from handlers.engine.core.sequence import Sequence
from rollcore.prefix_keys import prompt_keys
from rollcore.types import FinishReason, GenerationRequest, SamplingParams
from serving.batching.rolling import RollingBatcher
from serving.batching.routing import LEAST_LOADED, PrefixIndex, Router
from serving.ipc.messages import Deltas
from tests.unit.batcher_fakes import FakeWorker, added, delta, run

BS = 4


def keys(ids: list[int], salt: str | None = None) -> list[int]:
    return prompt_keys(ids, BS, None, salt)


def router(k: int = 2, held: dict[int, list[int]] | None = None) -> Router[str]:
    r: Router[str] = Router(max_imbalance=k)
    for wid, ks in (held or {}).items():
        r.index.update(wid, {"add": ks, "del": [], "block_size": BS})
    return r


PROMPT = list(range(1, 17))  # four full blocks


def test_the_worker_holding_the_longest_prefix_wins() -> None:
    ks = keys(PROMPT)
    r = router(held={1: ks[:1], 2: ks[:3], 3: ks[1:]})  # worker 3 holds later blocks but not the first
    assert r.choose([("a", 1, 0), ("b", 2, 1), ("c", 3, 0)], 8, ks) == "b"
    assert r.num_routed_by_prefix == 1


def test_a_tie_goes_to_the_least_loaded() -> None:
    ks = keys(PROMPT)
    r = router(held={1: ks[:2], 2: ks[:2]})
    assert r.choose([("a", 1, 1), ("b", 2, 0)], 8, ks) == "b"
    assert r.choose([("a", 1, 0), ("b", 2, 0), ("c", 3, 0)], 8, keys([9] * 16)) == "a"  # no hit: least loaded
    assert r.num_routed_by_prefix == 0


def test_the_imbalance_bound_and_capacity_outrank_the_prefix() -> None:
    ks = keys(PROMPT)
    r = router(k=2, held={1: ks})
    assert r.choose([("a", 1, 1), ("b", 2, 0)], 8, ks) == "a"  # one ahead: within the bound of 2
    assert r.choose([("a", 1, 2), ("b", 2, 0)], 8, ks) == "b"  # two ahead: not chosen
    assert r.choose([("a", 1, 3), ("b", 2, 3)], 4, ks) == "a"
    assert r.choose([("a", 1, 4), ("b", 2, 3)], 4, ks) == "b"  # full
    assert r.choose([("a", 1, 4), ("b", 2, 4)], 4, ks) is None


@pytest.mark.parametrize("k", [1, 2, 5])
def test_routing_never_puts_a_worker_more_than_the_bound_ahead(k: int) -> None:
    """Every prompt shares the prefix worker 1 holds: a request never makes its worker more than k requests busier
    than the least loaded one (finishing requests may spread them more; routing then evens them out)."""
    rng = random.Random(k)
    ks = keys(PROMPT)
    r = router(k=k, held={1: ks, 2: ks[:1]})
    loads = {1: 0, 2: 0, 3: 0}
    for _ in range(500):
        if rng.random() < 0.6:
            floor = min(loads.values())
            wid = r.choose([(w, w, n) for w, n in loads.items()], 1000, ks)
            assert wid is not None
            loads[wid] += 1
            assert loads[wid] - floor <= k
        else:  # a request finishes on a random busy worker (only lowering a load can spread them beyond k)
            busy = [w for w, n in loads.items() if n]
            if busy:
                loads[rng.choice(busy)] -= 1
    assert r.num_routed_by_prefix > 0


def test_least_loaded_ignores_the_prefix() -> None:
    r: Router[str] = Router(LEAST_LOADED, 2)
    r.index.update(1, {"add": keys(PROMPT), "block_size": BS})
    req = GenerationRequest("r", "m", prompt_token_ids=tuple(PROMPT))
    assert r.prompt_keys(req) == []
    assert r.choose([("a", 1, 1), ("b", 2, 0)], 8, []) == "b"
    with pytest.raises(ValueError, match="max_imbalance"):
        Router(max_imbalance=0)


def test_the_index_applies_reports_in_order_and_stays_bounded() -> None:
    index = PrefixIndex(max_keys=3)
    index.update(1, {"add": [1, 2], "del": [], "block_size": BS})
    index.update(1, {"add": [3], "del": [1]})
    assert index.matched(1, [2, 3, 4]) == 2 and index.matched(1, [1, 2]) == 0
    index.update(1, {"add": [4, 5], "del": []})  # over the bound: the oldest (2) goes
    assert index.num_keys(1) == 3 and index.matched(1, [2]) == 0
    index.update(1, {"reset": True, "add": [7], "del": []})
    assert index.num_keys(1) == 1
    index.update(1, {"add": ["x", True, 8], "del": None})  # junk in a report is ignored
    assert index.num_keys(1) == 2 and index.block_size == BS
    index.forget(1)
    assert index.matched(1, [7]) == 0


def _run(sched: Scheduler, seq: Sequence) -> None:
    """Prefill ``seq`` and finish it after one token (its full blocks stay cached)."""
    sched.add(seq)
    while seq.num_output_tokens == 0:
        out = sched.schedule()
        sched.commit(out)
        for c in out.chunks:
            if c.samples:
                c.seq.append_token(7)
    sched.finish(seq)


def test_the_engine_reports_the_keys_the_frontend_computes() -> None:
    """Keys registered and evicted by the engine's cache, as the router computes them from token ids and salt."""
    sched = Scheduler(SchedulerConfig(num_blocks=6, block_size=BS, max_model_len=64, max_num_batched_tokens=64))
    ids = PROMPT + [99]  # the block holding the last token is never reused: four full blocks are
    _run(sched, Sequence("a", ids, SamplingParams(max_new_tokens=1, cache_salt="t1")))
    events = sched.allocator.take_events()
    assert events is not None and events["del"] == []
    assert events["add"] == keys(PROMPT, "t1") and keys(PROMPT, "t1") != keys(PROMPT)
    assert sched.allocator.take_events() is None  # taken once
    request = GenerationRequest("r", "m", prompt_token_ids=tuple(ids), params=SamplingParams(cache_salt="t1"))
    r = router(held={1: events["add"]})  # type: ignore[dict-item]
    assert r.prompt_keys(request) == keys(PROMPT, "t1")
    # another prompt needs the cached blocks: the evicted keys are reported, net of what came back
    _run(sched, Sequence("b", list(range(50, 66)) + [99], SamplingParams(max_new_tokens=1)))
    events = sched.allocator.take_events()
    assert events is not None and set(events["del"]) <= set(keys(PROMPT, "t1")) and events["del"]  # type: ignore
    assert events["add"] == keys(list(range(50, 66)))


def test_a_salted_prompt_misses_another_salts_blocks() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=BS, max_model_len=64, max_num_batched_tokens=64))
    ids = PROMPT + [99]
    _run(sched, Sequence("a", ids, SamplingParams(max_new_tokens=1, cache_salt="t1")))
    other = Sequence("b", ids, SamplingParams(max_new_tokens=1, cache_salt="t2"))
    _run(sched, other)
    unsalted = Sequence("c", ids, SamplingParams(max_new_tokens=1))
    _run(sched, unsalted)
    same = Sequence("d", ids, SamplingParams(max_new_tokens=1, cache_salt="t1"))
    _run(sched, same)
    assert (other.num_cached_prompt_tokens, unsalted.num_cached_prompt_tokens) == (0, 0)
    assert same.num_cached_prompt_tokens == 16


# --- the batcher ---
def _ready(b: RollingBatcher, *workers: FakeWorker) -> None:
    for w in workers:
        b.worker_ready(w)


def _report(b: RollingBatcher, w: FakeWorker, ids: list[int], salt: str | None = None) -> None:
    b.on_message(w, Deltas(step=1, deltas=[], prefix={"add": keys(ids, salt), "del": [], "block_size": BS}))


def _req(rid: str, ids: list[int], **kw: Any) -> GenerationRequest:
    params = SamplingParams(cache_salt=kw.pop("salt", None))
    return GenerationRequest(request_id=rid, model="m", prompt_token_ids=tuple(ids), params=params, **kw)


def test_the_batcher_sends_a_prompt_to_the_worker_holding_its_prefix() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=8, job_queue_size=10, predict_timeout_s=30,
                           router=Router(max_imbalance=2))
        w1, w2 = FakeWorker(1), FakeWorker(2)
        _ready(b, w1, w2)
        _report(b, w2, PROMPT + [5])
        b.submit(_req("turn2", PROMPT + [5, 6, 7, 8, 9]))
        b.submit(_req("salted", PROMPT + [5, 6, 7, 8, 9], salt="other"))  # another salt: no hit, least loaded
        assert added(w2) == ["turn2"] and added(w1) == ["salted"]
        b.submit(_req("again", PROMPT))
        b.submit(_req("third", PROMPT))  # worker 2 is one ahead of worker 1: within the bound of 2
        b.submit(_req("fourth", PROMPT))  # two ahead: the bound sends it to worker 1
        assert added(w2) == ["turn2", "again", "third"] and added(w1) == ["salted", "fourth"]
        assert b.describe()["routing"]["routed_by_prefix_total"] == 3
        w2.alive = False
        b.worker_lost(w2)  # its cache went with it
        assert b.router.index.num_keys(2) == 0

    run(main())


def test_a_user_sticks_to_its_worker_within_the_bound() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=8, job_queue_size=10, predict_timeout_s=30,
                           router=Router(max_imbalance=2))
        w1, w2 = FakeWorker(1), FakeWorker(2)
        _ready(b, w1, w2)
        b.submit(_req("a1", [1], affinity="user:ann"))
        b.submit(_req("b1", [2], affinity="user:bob"))
        b.submit(_req("a2", [3], affinity="user:ann"))
        assert added(w1) == ["a1", "a2"] and added(w2) == ["b1"]
        b.submit(_req("a3", [4], affinity="user:ann"))  # worker 1 runs one more than worker 2: within the bound
        b.submit(_req("a4", [5], affinity="user:ann"))  # two more: ann moves to worker 2
        assert added(w1) == ["a1", "a2", "a3"] and added(w2) == ["b1", "a4"]
        for rid in ("b1", "a4"):
            b.on_message(w2, Deltas(step=2, deltas=[delta(rid, 1, FinishReason.LENGTH)]))
        b.submit(_req("a5", [6], affinity="user:ann"))  # worker 2 is now the least loaded: ann stays there
        assert added(w2)[-1] == "a5"

    run(main())


def test_a_pinned_key_ignores_the_bound() -> None:
    """A key pinned to a worker (a probe of that very worker) is not moved however busy the worker is."""
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=8, job_queue_size=10, predict_timeout_s=30,
                           router=Router(max_imbalance=1))
        w1, w2 = FakeWorker(1), FakeWorker(2)
        _ready(b, w1, w2)
        b.submit(_req("x", [1]))
        b.pin("probe", 1)
        b.submit(replace(_req("p", [2]), affinity="probe"))
        assert added(w1) == ["x", "p"]

    run(main())


def test_openai_sessions_are_keyed_by_prompt_cache_key_then_user() -> None:
    from serving.frontends.http.openai_schema import affinity
    from serving.requests.bodies import ChatRequest

    def key(**fields: Any) -> str | None:
        return affinity(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields}))

    assert key(user="ann", prompt_cache_key="k1") == "prompt_cache_key:k1"
    assert key(user="ann") == "user:ann" and key() is None
    assert key(prompt_cache_key="user:ann") != key(user="ann")  # neither names the other's key
