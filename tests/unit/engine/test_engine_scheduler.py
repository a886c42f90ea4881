"""Property tests of the scheduler with synthetic sequences: no model, no torch."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.engine.core.scheduler import Scheduler, SchedulerConfig
from handlers.engine.core.sequence import FREED_BLOCK, Sequence, SequenceStatus
from rollcore.errors import InvalidRequest
from rollcore.types import SamplingParams


def _check_blocks(sched: Scheduler) -> None:
    alloc = sched.allocator
    refs = Counter(b for s in sched.live_sequences() for b in s.block_ids if b != FREED_BLOCK)
    assert all(alloc.ref_count(b) == refs.get(b, 0) for b in range(alloc.num_blocks))
    assert alloc.num_used_blocks == len(refs)
    for s in sched.waiting:
        assert s.block_ids == [] or s.status is SequenceStatus.RUNNING


request = st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3))  # prompt len, max_new, arrival


@settings(max_examples=80, deadline=None)
@given(
    st.lists(request, min_size=1, max_size=14),
    st.integers(4, 24),  # num_blocks
    st.integers(1, 6),  # max_num_seqs
    st.sampled_from([1, 4, 8, 32]),  # max_num_batched_tokens
    st.booleans(),  # prefix caching
    st.sets(st.integers(0, 13), max_size=4),  # which requests get aborted
    st.integers(0, 2),  # shared prefix kinds
    st.sampled_from([0, 4, 9]),  # sliding window of every layer (blocks out of it are freed)
    st.sampled_from([0, 1, 3]),  # prefill tokens per step while decodes run
    st.booleans(),  # a burst's prompts before the running streams
)
def test_every_request_finishes_once(reqs, num_blocks, max_seqs, max_tokens, prefix, aborts, kinds, window,
                                     decode_cap, burst_first) -> None:
    bs = 4
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, block_size=bs,
                          num_blocks=num_blocks, max_model_len=64, enable_prefix_caching=prefix,
                          sliding_window=window, max_prefill_tokens_while_decoding=decode_cap,
                          burst_prefill_first=burst_first)
    sched = Scheduler(cfg)
    pending = sorted(enumerate(reqs), key=lambda r: r[1][2])
    finished: Counter[str] = Counter()
    accepted: set[str] = set()
    step = 0
    while (pending or sched.has_work()) and step < 2000:
        while pending and pending[0][1][2] <= step:
            i, (plen, max_new, _) = pending.pop(0)
            prompt = [(i % (kinds + 1)) + 5] * 8 + list(range(100 + i, 100 + i + plen))
            seq = Sequence(f"r{i}", prompt, SamplingParams(max_new_tokens=max_new))
            try:
                sched.add(seq)
                accepted.add(seq.request_id)
            except InvalidRequest as e:
                assert len(prompt) + max_new > min(64, num_blocks * bs), str(e)
        out = sched.schedule()
        assert out.num_batched_tokens <= max_tokens
        assert len(sched.running) <= max_seqs
        assert len({id(c.seq) for c in out.chunks}) == len(out.chunks)
        _check_blocks(sched)
        for c in out.chunks:
            assert c.seq.status is SequenceStatus.RUNNING
            assert len(c.seq.block_ids) * bs >= c.start + c.num_tokens
            if window:  # every block a query of this chunk can see is live
                first = max(0, c.start - window + 1) // bs
                assert all(b != FREED_BLOCK for b in c.seq.block_ids[first:])
        sched.commit(out)
        for c in out.chunks:
            if c.samples:
                c.seq.append_token(7)
                if c.seq.num_output_tokens >= c.seq.params.max_new_tokens:
                    sched.finish(c.seq)
                    finished[c.seq.request_id] += 1
        for i in list(aborts):
            if step == i and sched.abort(f"r{i}") is not None:
                finished[f"r{i}"] += 1
        _check_blocks(sched)
        step += 1
    assert not sched.has_work()
    assert set(finished) == accepted and all(v == 1 for v in finished.values())
    assert sched.allocator.num_used_blocks == 0


def test_rejects_what_can_never_fit() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, max_model_len=100))
    with pytest.raises(InvalidRequest, match="10 tokens.*max_new_tokens \\(7\\)"):
        sched.add(Sequence("a", list(range(10)), SamplingParams(max_new_tokens=7)))
    with pytest.raises(InvalidRequest, match="maximum length of 100"):
        sched.add(Sequence("b", list(range(90)), SamplingParams(max_new_tokens=11)))
    with pytest.raises(InvalidRequest, match="empty"):
        sched.add(Sequence("c", [], SamplingParams()))


def test_chunked_prefill_keeps_decodes_flowing() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=64))
    short = Sequence("short", [1, 2, 3], SamplingParams(max_new_tokens=20))
    sched.add(short)
    out = sched.schedule()
    sched.commit(out)
    short.append_token(9)
    sched.add(Sequence("long", list(range(30)), SamplingParams(max_new_tokens=2)))
    for _ in range(4):
        out = sched.schedule()
        ids = {c.seq.request_id: c.num_tokens for c in out.chunks}
        assert ids["short"] == 1 and ids["long"] == 7
        sched.commit(out)
        short.append_token(9)


def test_preemption_frees_and_requeues_newest() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, block_size=4, num_blocks=4,
                                      enable_prefix_caching=False))
    a = Sequence("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=8))
    b = Sequence("b", [5, 6, 7, 8], SamplingParams(max_new_tokens=8))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["a", "b"]
    sched.commit(out)
    for s in (a, b):
        s.append_token(0)
    out = sched.schedule()  # both need a second block: 4 blocks in all, so fine
    sched.commit(out)
    for _ in range(4):
        for s in (a, b):
            if s.status is SequenceStatus.RUNNING:
                s.append_token(0)
        out = sched.schedule()
        sched.commit(out)
    assert sched.num_preemptions >= 1
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and sched.waiting[0] is b


def test_prefill_tokens_capped_while_decodes_run() -> None:
    """A long prompt arriving while others decode is prefilled in chunks of the cap; alone it takes the budget."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, block_size=16, num_blocks=512,
                                      max_prefill_tokens_while_decoding=256))
    first = Sequence("first", list(range(1000)), SamplingParams(max_new_tokens=50))
    sched.add(first)
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("first", 1000)]  # nothing decodes yet
    sched.commit(out)
    first.append_token(3)
    sched.add(Sequence("second", list(range(5000, 6000)), SamplingParams(max_new_tokens=5)))
    sizes = []
    while True:
        out = sched.schedule()
        chunks = {c.seq.request_id: c.num_tokens for c in out.chunks}
        assert chunks["first"] == 1
        sched.commit(out)
        first.append_token(3)
        if "second" not in chunks:
            break
        sizes.append(chunks["second"])
        if sum(sizes) >= 1000:
            break
    assert sizes == [256, 256, 256, 232]


def _decoding(sched: Scheduler, *ids: str, max_new: int = 50, written: int = 1) -> dict[str, Sequence]:
    """Add one two-token request per id and step until each has written ``written`` tokens (nothing else runs)."""
    seqs = {i: Sequence(i, [ord(i[0]), 2], SamplingParams(max_new_tokens=max_new)) for i in ids}
    for seq in seqs.values():
        sched.add(seq)
    while any(s.num_output_tokens < written for s in seqs.values()):
        _step_all(sched)
    return seqs


def _plan(sched: Scheduler) -> dict[str, int]:
    """One step: request id -> tokens it computes (sampled sequences get a token)."""
    out = sched.schedule()
    sched.commit(out)
    for c in out.chunks:
        if c.samples:
            c.seq.append_token(7)
    return {c.seq.request_id: c.num_tokens for c in out.chunks}


def test_a_burst_is_prefilled_while_the_running_streams_wait() -> None:
    """Three prompts arrive beside one decoding stream: they get the steps until each has its first token, the
    stream none; then all four decode. Without the option the stream decodes in every step."""
    for first in (True, False):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=64,
                                          max_prefill_tokens_while_decoding=0, burst_prefill_first=first))
        _decoding(sched, "a", max_new=250, written=100)
        for k, i in enumerate("bcd"):
            sched.add(Sequence(i, list(range(100 * k, 100 * k + 12)), SamplingParams(max_new_tokens=5)))
        steps = [_plan(sched) for _ in range(4)]
        if first:
            assert steps == [{"b": 12, "c": 4}, {"c": 8, "d": 8}, {"d": 4}, {"a": 1, "b": 1, "c": 1, "d": 1}]
            assert sched.num_paused_steps == 3
        else:
            assert steps == [{"a": 1, "b": 12, "c": 3}, {"a": 1, "b": 1, "c": 9, "d": 5},
                             {"a": 1, "b": 1, "c": 1, "d": 7}, {"a": 1, "b": 1, "c": 1, "d": 1}]
            assert sched.num_paused_steps == 0


def test_arrivals_after_a_burst_began_do_not_extend_it() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=64,
                                      max_prefill_tokens_while_decoding=0, burst_prefill_first=True))
    _decoding(sched, "a", max_new=250, written=100)
    for k, i in enumerate("bc"):
        sched.add(Sequence(i, list(range(100 * k, 100 * k + 12)), SamplingParams(max_new_tokens=5)))
    assert _plan(sched) == {"b": 8}  # the burst: b and c, 24 tokens, three steps
    sched.add(Sequence("late", list(range(30, 38)), SamplingParams(max_new_tokens=5)))
    assert _plan(sched) == {"b": 4, "c": 4}
    assert _plan(sched) == {"c": 8}
    # b and c have their first tokens: the streams decode again, and the late request is one waiting beside
    # three decoding (no burst), prefilled beside them
    assert _plan(sched) == {"a": 1, "b": 1, "c": 1, "late": 5}


@pytest.mark.parametrize("prompt", [8, 9])
def test_a_burst_of_two_steps_or_less_is_prefilled_beside_the_streams(prompt: int) -> None:
    """Pausing pays only where it saves stalls: prompts that fit in two steps at the cap stall each stream at
    most twice beside them, so the stream keeps decoding; one token more and it is a burst."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=64,
                                      max_prefill_tokens_while_decoding=0, burst_prefill_first=True))
    _decoding(sched, "a", max_new=250, written=100)
    for k, i in enumerate("bc"):
        sched.add(Sequence(i, list(range(100 * k, 100 * k + prompt)), SamplingParams(max_new_tokens=5)))
    if prompt == 8:  # 16 tokens, two steps of 8
        assert [_plan(sched) for _ in range(3)] == [{"a": 1, "b": 7}, {"a": 1, "b": 1, "c": 6},
                                                    {"a": 1, "b": 1, "c": 2}]
        assert sched.num_paused_steps == 0
    else:
        assert [_plan(sched) for _ in range(3)] == [{"b": 8}, {"b": 1, "c": 7}, {"c": 2}]
        assert sched.num_paused_steps == 3


@pytest.mark.parametrize(("max_new", "written"), [(1000, 99), (1000, 100), (199, 100), (200, 100)])
def test_streams_near_their_end_are_not_paused(max_new: int, written: int) -> None:
    """One stall is a large share of a short answer's gaps: a burst pauses only streams likely to write 100 tokens
    or more, a guess made of what they wrote so far (a stream half-way through), capped by their max_new_tokens
    (a stop condition) but never taken from it: a client's max_tokens says little of the answer's length."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=256,
                                      max_prefill_tokens_while_decoding=0, burst_prefill_first=True))
    _decoding(sched, "a", "b", max_new=max_new, written=written)
    for k, i in enumerate("cde"):
        sched.add(Sequence(i, list(range(100 * k, 100 * k + 12)), SamplingParams(max_new_tokens=5)))
    if min(max_new - written, written) < 100:
        assert _plan(sched) == {"a": 1, "b": 1, "c": 6}
    else:
        assert _plan(sched) == {"c": 8}
        assert sched.num_paused_steps == 1


@pytest.mark.parametrize("limit", ["slots", "blocks"])
def test_the_streams_decode_when_no_waiting_prompt_can_start(limit: str) -> None:
    """A burst that cannot run (the batch is full, or its blocks do not fit) must not hold up the streams."""
    slots, blocks = (2, 64) if limit == "slots" else (8, 20)
    sched = Scheduler(SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=128, block_size=16,
                                      num_blocks=blocks, max_model_len=320, max_prefill_tokens_while_decoding=0,
                                      enable_prefix_caching=False, burst_prefill_first=True))
    # long streams (100 written, as many likely to come), each in seven blocks with room for its next tokens
    _decoding(sched, "a", "b", max_new=300, written=100)
    for k, i in enumerate("cde"):  # a first chunk of seven blocks each (blocks: six are free)
        sched.add(Sequence(i, [k, *range(2, 101)], SamplingParams(max_new_tokens=3)))
    assert _plan(sched) == {"a": 1, "b": 1}
    assert sched.num_paused_steps == 0


def _step_all(sched: Scheduler) -> list[str]:
    """One step in which every sampled sequence gets a token (finishing at its max_new_tokens); returns the
    ids the step admitted."""
    before = {s.request_id for s in sched.running}
    out = sched.schedule()
    sched.commit(out)
    for c in out.chunks:
        if c.samples:
            c.seq.append_token(7)
            if c.seq.num_output_tokens >= c.seq.params.max_new_tokens:
                sched.finish(c.seq)
    return [c.seq.request_id for c in out.chunks if c.seq.request_id not in before]


def test_lowering_max_num_seqs_admits_nothing_until_fewer_run_and_never_preempts() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=4, num_blocks=256))
    for i in range(8):  # staggered lengths: one finishes per step from the 3rd step on
        sched.add(Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=2 + i)))
    for i in range(8, 20):
        sched.add(Sequence(f"w{i}", [4, 5, 6], SamplingParams(max_new_tokens=50)))
    assert len(_step_all(sched)) == 8
    sched.set_limits(max_num_seqs=3)
    assert sched.config.max_num_seqs == 3 and sched.config.max_num_batched_tokens == 512
    assert sched.limits.as_dict() == {"changes": 1, "changed_at_schedule": 1, "running_at_change": 8,
                                      "waiting_at_change": 12, "first_step_admitted": None,
                                      "admitted_since_change": 0, "peak_running_admitting": 0}
    running = []
    while len(sched.running) >= 3:
        assert _step_all(sched) == []  # nothing admitted while 3 or more run
        running.append(len(sched.running))
    assert running == [7, 6, 5, 4, 3, 2]  # one finished per step, none preempted
    assert sched.num_preemptions == 0
    assert _step_all(sched) == ["w8"]  # 2 run: the next step admits one, up to the new limit
    for _ in range(5):
        _step_all(sched)
        assert len(sched.running) <= 3
    record = sched.limits
    assert record.first_step_admitted == 0 and record.peak_running_admitting == 3
    assert record.admitted_since_change == 12 - len(sched.waiting)


def test_raising_max_num_seqs_admits_the_waiting_at_the_next_step() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, block_size=4, num_blocks=256))
    for i in range(10):
        sched.add(Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=50)))
    assert _step_all(sched) == ["r0", "r1"]
    assert _step_all(sched) == []
    sched.set_limits(max_num_seqs=6, max_num_batched_tokens=100)
    assert sched.limits.running_at_change == 2 and sched.limits.waiting_at_change == 8
    assert _step_all(sched) == ["r2", "r3", "r4", "r5"]
    assert sched.limits.first_step_admitted == 4 and sched.limits.peak_running_admitting == 6
    sched.set_limits(max_num_seqs=10, max_num_batched_tokens=7)  # 6 decodes + one prompt token
    assert sched.limits.changes == 2 and sched.limits.first_step_admitted is None
    out = sched.schedule()
    assert out.num_batched_tokens == 7 and [(c.seq.request_id, c.num_tokens) for c in out.chunks][-1] == ("r6", 1)
    assert sched.limits.first_step_admitted == 1


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_set_limits_refuses_bad_values_and_changes_nothing(bad: object) -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4))
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        sched.set_limits(max_num_seqs=bad)  # type: ignore[arg-type]
    assert sched.config.max_num_seqs == 4 and sched.limits.changes == 0
