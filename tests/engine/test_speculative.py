"""Prompt-lookup speculative decoding: the drafter's guesses, and an engine whose output stays plain decoding's
(greedy == generate, stops inside a confirmed run, sampled and logprobs requests in the same batch) in fewer
steps. The family matrix runs every family with speculation too (``test_families.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.engine.core.scheduler import Scheduler, SchedulerConfig
from handlers.engine.core.sequence import Sequence
from handlers.engine.core.speculative import MAX_PAUSE, NgramDrafter, accepted_prefix
from handlers.engine.engine import LLMEngine
from handlers.engine.execution.decoding.sampling import SampledToken
from handlers.engine.planning.engine_config import EngineConfig
from rollcore.errors import ConfigError
from rollcore.types import FinishReason, SamplingParams, TokenDelta
from serving.ipc.codec import decode_body, encode
from serving.ipc.messages import Deltas
from tests.engine.conftest import make_prompts, reference_greedy

SPEC = {"num_kv_blocks": "256", "speculative_draft": "ngram", "num_speculative_tokens": "4",
        "speculative_max_batch_size": "0"}
MAX_NEW = 40


# ------------------------------------------------------------------ the drafter
def test_the_drafter_proposes_what_followed_the_first_occurrence_of_the_longest_suffix() -> None:
    d = NgramDrafter(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 8, 2, 3, 4, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 1..3: what followed is 9, 8, 2, 3
    assert d.propose(tokens, 4) == [9, 8, 2, 3]
    assert d.propose(tokens, 2) == [9, 8]
    # a suffix seen only as a 1-gram: (5) never, (3) first at 3 -> 9 ...; (x, 3) for x=5 unseen
    assert d.propose([*tokens, 5, 3], 3) == [9, 8, 2]
    assert NgramDrafter(2, 3).propose([4, 5, 6, 4], 3) == []  # no 2-gram suffix occurred before
    assert d.propose([1], 3) == [] and d.propose(tokens, 0) == []
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(3, 2)


def test_the_drafter_indexes_incrementally_as_the_sequence_grows() -> None:
    d = NgramDrafter(1, 2)
    tokens = [1, 2, 3]
    assert d.propose(tokens, 2) == []
    tokens += [1]
    assert d.propose(tokens, 2) == [2, 3]
    tokens += [2]
    assert d.propose(tokens, 5) == [3, 1, 2]  # (1, 2) first at 0: what followed, up to the end


def test_a_missing_drafter_pauses_longer_after_each_miss_and_resumes_on_a_hit() -> None:
    d = NgramDrafter(1, 1)
    tokens = [1, 2, 1]
    for pause in (1, 2, 4, 8, 16, MAX_PAUSE):
        assert d.propose(tokens, 1) == [2]
        d.record(1, 0)  # missed
        assert [d.propose(tokens, 1) for _ in range(pause)] == [[]] * pause
    assert d.propose(tokens, 1) == [2]
    d.record(1, 1)  # a hit: no pause, and the next miss pauses one step again
    assert d.propose(tokens, 1) == [2]
    d.record(1, 0)
    assert d.propose(tokens, 1) == [] and d.propose(tokens, 1) == [2]


def test_accepted_prefix() -> None:
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 9]) == 2
    assert accepted_prefix([4, 5, 6], [1, 5, 6, 9]) == 0
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 9]) == 3


def test_prompt_lookup_sizes_are_checked() -> None:
    with pytest.raises(ConfigError, match="prompt_lookup_min = 4 exceeds option.prompt_lookup_max = 2"):
        EngineConfig.from_options({"prompt_lookup_min": "4", "prompt_lookup_max": "2"})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.from_options({"num_speculative_tokens": "17"})
    assert EngineConfig.from_options({"speculative_draft": "ngram"}).num_speculative_tokens == 8


# --------------------------------------------------------------- the scheduler
def test_guesses_use_only_spare_blocks_and_the_token_budget() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=4, max_num_batched_tokens=64))
    seq = Sequence("a", [1, 2, 3, 1, 2, 3], SamplingParams(max_new_tokens=10))
    sched.add(seq)
    sched.commit(sched.schedule())  # the prompt: 2 blocks
    seq.append_token(1)
    sched.drafter = lambda s: [2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    plan = sched.schedule()
    (chunk,) = plan.chunks
    # 4 blocks, one kept free per running sequence: 3 blocks = 12 slots, positions 6.. -> 1 token + 5 guesses
    assert (chunk.start, chunk.num_tokens, len(chunk.draft)) == (6, 1, 5)
    assert sched.allocator.num_free_blocks == 1 and plan.preempted_ids == ()
    assert plan.num_batched_tokens == 6
    sched.commit(plan)
    assert seq.num_computed_tokens == 7
    seq.token_ids += [2, 3, 9]  # two guesses confirmed, then the model's own token
    sched.accept_draft(seq, 2)
    assert seq.num_computed_tokens == 9 and len(seq.block_hashes) == 2  # positions 0..7 fill two blocks

    tight = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_num_batched_tokens=3))
    tight.drafter = lambda s: [1, 2, 1, 2]
    other = Sequence("b", [1, 2, 1], SamplingParams(max_new_tokens=20))
    tight.add(other)
    tight.commit(tight.schedule())
    other.append_token(2)
    (chunk,) = tight.schedule().chunks
    assert len(chunk.draft) == 2  # the step's budget of 3 tokens: the decode and two guesses


def test_guesses_stop_above_the_speculative_batch_size() -> None:
    """Only while at most max_speculative_batch sequences decode (beyond, a step's matmuls are compute-bound
    and every guessed row costs as much as a real one)."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_speculative_batch=2))
    seqs = [Sequence(f"s{i}", [1, 2, 1], SamplingParams(max_new_tokens=20)) for i in range(3)]
    for seq in seqs[:2]:
        sched.add(seq)
    sched.commit(sched.schedule())
    for seq in seqs[:2]:
        seq.append_token(2)
    sched.drafter = lambda s: [1, 2]
    plan = sched.schedule()
    assert [len(c.draft) for c in plan.chunks] == [2, 2]
    sched.commit(plan)
    for seq in seqs[:2]:
        seq.append_token(1)
    sched.add(seqs[2])
    sched.commit(sched.schedule())  # the third one's prompt (the two decoding ones may still guess)
    for seq in seqs:
        seq.append_token(2)
    plan = sched.schedule()
    assert len(plan.chunks) == 3 and [len(c.draft) for c in plan.chunks] == [0, 0, 0]


# ------------------------------------------------------------------ the engine
class Run:
    """Each request's deltas, and how many tokens it got at each step that gave it any."""

    def __init__(self) -> None:
        self.deltas: dict[str, list[TokenDelta]] = {}
        self.per_step: dict[str, list[int]] = {}
        self.steps = 0

    def __getitem__(self, request_id: str) -> list[TokenDelta]:
        return self.deltas[request_id]

    def values(self) -> list[list[TokenDelta]]:
        return list(self.deltas.values())

    def confirmed_runs(self, request_id: str) -> int:
        """Steps that gave this request more than one token."""
        return sum(n > 1 for n in self.per_step[request_id])


def run_all(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    run = Run()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add(f"r{i}", p, sp)
        run.deltas[f"r{i}"] = []
        run.per_step[f"r{i}"] = []
    while engine.has_work():
        got: dict[str, int] = {}
        for d in engine.step():
            run.deltas[d.request_id].append(d)
            got[d.request_id] = got.get(d.request_id, 0) + len(d.tokens)
        for rid, n in got.items():
            run.per_step[rid].append(n)
        run.steps += 1
    return run


def ids(deltas: list[TokenDelta]) -> list[int]:
    return [t.id for d in deltas for t in d.tokens]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculative_greedy_equals_generate_in_fewer_steps(model_dirs: dict[str, Path], arch: str) -> None:
    prompts = make_prompts(8, seed=11)
    params = [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    plain = run_all(LLMEngine.from_options(model_dirs[arch], {"num_kv_blocks": "256"}), prompts, params)
    engine = LLMEngine.from_options(model_dirs[arch], SPEC)
    spec = run_all(engine, prompts, params)
    for i, p in enumerate(prompts):
        assert ids(spec[f"r{i}"]) == reference_greedy(model_dirs[arch], p, MAX_NEW) == ids(plain[f"r{i}"])
        assert "".join(d.text for d in spec[f"r{i}"]) == "".join(d.text for d in plain[f"r{i}"])
        assert spec[f"r{i}"][0].prompt_tokens == len(p)
        assert [d.finish_reason for d in spec[f"r{i}"]][-1] is FinishReason.LENGTH
    stats = engine.stats()
    assert stats["spec_accepted_tokens_total"] > 0
    assert all(len(d.tokens) == 1 for ds in spec.values() for d in ds)  # a delta per token, its own text
    assert sum(spec.confirmed_runs(f"r{i}") for i in range(len(prompts))) > 0
    assert spec.steps < plain.steps
    assert stats["generation_tokens_total"] == MAX_NEW * len(prompts)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_blocks_filled_by_confirmed_guesses_serve_the_prefix_cache(model_dirs: dict[str, Path]) -> None:
    """Blocks filled by confirmed guesses are registered with the tokens they hold: a later prompt that continues
    an earlier answer reuses them (prefix-cache hits past the old prompt) and still gets generate's tokens."""
    model_dir = model_dirs["llama"]
    prompts = make_prompts(6, seed=11)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    engine = LLMEngine.from_options(model_dir, {**SPEC, "block_size": "4"})
    first = run_all(engine, prompts, [greedy] * len(prompts))
    assert sum(first.confirmed_runs(f"r{i}") for i in range(len(prompts))) > 0
    followups = [p + ids(first[f"r{i}"])[:32] for i, p in enumerate(prompts)]
    hits_before = engine.stats()["prefix_cache_hits_total"]
    second = run_all(engine, followups, [SamplingParams(max_new_tokens=16, ignore_eos=True)] * len(prompts))
    for i, p in enumerate(followups):
        assert ids(second[f"r{i}"]) == reference_greedy(model_dir, p, 16), f"follow-up {i}"
    # every follow-up reuses the blocks of its prompt and of its answer's first 32 tokens (8 blocks of 4)
    reused = engine.stats()["prefix_cache_hits_total"] - hits_before
    assert reused >= sum(len(p) // 4 for p in prompts) + 7 * len(prompts)


def test_a_confirmed_guess_counts_as_computed(model_dirs: dict[str, Path]) -> None:
    """After a step that confirmed guesses, the sequence's next step is one decode token, not a recompute."""
    engine = LLMEngine.from_options(model_dirs["llama"], SPEC)
    prompt = make_prompts(1, seed=11)[0]
    engine.add("x", prompt, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    seq = engine.scheduler.get("x")
    assert seq is not None
    confirmed_steps = 0
    while engine.has_work():
        deltas = engine.step()
        if deltas[-1].finish_reason is None:
            assert seq.num_computed_tokens == seq.num_tokens - 1
            confirmed_steps += len(deltas) > 1
    assert confirmed_steps > 0


def test_a_stop_token_inside_a_confirmed_run_ends_it_there(model_dirs: dict[str, Path]) -> None:
    """A stop token among the tokens a verified chunk emits ends the request there: the confirmed tokens after
    it are dropped (plain decoding never produces them) and the request's blocks are freed. Guesses never reach
    past max_new_tokens: the drafter is asked for at most the tokens left after the model's own."""
    engine = LLMEngine.from_options(model_dirs["llama"], SPEC)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    engine.add("x", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, stop_token_ids=(99,)))
    (first,) = engine.step()  # the prompt's step: one token, no guess
    seq = engine.scheduler.get("x")
    assert seq is not None and seq.num_output_tokens == 1
    # the engine emits a verified chunk's tokens in order: a confirmed 41, then the stop token, then 42
    deltas = engine._advance_many(engine._requests["x"], [SampledToken(41), SampledToken(99), SampledToken(42)])
    assert [[t.id for t in d.tokens] for d in deltas] == [[41], [99]]
    assert [d.finish_reason for d in deltas] == [None, FinishReason.STOP]
    assert seq.token_ids[-2:] == [41, 99] and engine.scheduler.get("x") is None and not engine.has_work()
    assert engine.stats()["kv_blocks_used"] == 0

    engine.add("y", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.get("y")
    assert seq is not None
    seq.token_ids[-1] = 8  # ... 5 6 7 | 8: the drafter would guess 5 6 7 8 ...
    assert NgramDrafter().propose(seq.token_ids, 4) == [5, 6, 7, 8]
    assert engine._draft(seq) == [5, 6]  # 4 new tokens: 8 (out), the model's next, and at most 2 guesses


def test_stop_strings_inside_a_confirmed_run(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["llama"]
    prompts = make_prompts(8, seed=11)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    plain = run_all(LLMEngine.from_options(model_dir, {"num_kv_blocks": "256"}), prompts, [greedy] * 8)
    texts = ["".join(d.text for d in plain[f"r{i}"]) for i in range(8)]
    # a stop string from the middle of each text (4 characters a third of the way in)
    params = [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop=(t[len(t) // 3:len(t) // 3 + 4],))
              for t in texts]
    plain_stop = run_all(LLMEngine.from_options(model_dir, {"num_kv_blocks": "256"}), prompts, params)
    engine = LLMEngine.from_options(model_dir, SPEC)
    spec_stop = run_all(engine, prompts, params)
    for i in range(8):
        assert "".join(d.text for d in spec_stop[f"r{i}"]) == "".join(d.text for d in plain_stop[f"r{i}"])
        assert spec_stop[f"r{i}"][-1].finish_reason is FinishReason.STOP
    assert engine.stats()["spec_accepted_tokens_total"] > 0


def test_sampled_and_logprobs_requests_share_the_batch_unchanged(model_dirs: dict[str, Path]) -> None:
    """Greedy requests guess, with or without log-probabilities (each emitted token's come from the row that
    chose it); seeded sampling requests never guess. Every request gives what it gives without speculation."""
    model_dir = model_dirs["llama"]
    prompts = make_prompts(9, seed=11)
    params = []
    for i in range(9):
        if i % 3 == 0:
            params.append(SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, do_sample=True, temperature=0.9,
                                         seed=100 + i))
        else:
            params.append(SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=2, details=True))
    plain = run_all(LLMEngine.from_options(model_dir, {"num_kv_blocks": "256"}), prompts, params)
    engine = LLMEngine.from_options(model_dir, SPEC)
    spec = run_all(engine, prompts, params)
    for i in range(9):
        assert ids(spec[f"r{i}"]) == ids(plain[f"r{i}"]), f"request {i}"
        if i % 3 == 1:
            assert spec.confirmed_runs(f"r{i}") == 0  # never guessed
        if i % 3 == 2:
            got = [t for d in spec[f"r{i}"] for t in d.tokens]
            want = [t for d in plain[f"r{i}"] for t in d.tokens]
            assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-4)
            assert [[i for i, _ in t.top_logprobs] for t in got] == [[i for i, _ in t.top_logprobs] for t in want]
            assert all(len(t.top_logprobs) == 2 for t in got)
    assert sum(spec.confirmed_runs(f"r{i}") for i in (2, 5, 8)) > 0  # logprobs requests guessed too
    assert engine.stats()["spec_accepted_tokens_total"] > 0


QUOTES = ["Repeat this sentence word for word: The library opens at nine in the morning and closes at six in the "
          "evening, except on Sundays, when it stays closed all day.",
          "Copy the following list exactly: apples, pears, plums, cherries, grapes, lemons, oranges, peaches."]


def test_the_cost_gate_lets_guesses_through_on_the_real_model_and_keeps_greedy_output() -> None:
    """SmolLM2 asked to quote its prompt, one request at a time with the default ``speculative_max_batch_size``
    (auto): a one-row step is mostly the reading of the weights, so the gate gives guesses, the model confirms many,
    and every token is still transformers' greedy choice."""
    from tests.real_model import smollm2_folder

    folder = smollm2_folder()
    engine = LLMEngine.from_options(folder, {"num_kv_blocks": "128", "speculative_draft": "ngram"})
    assert engine.draft_gate is not None and engine.config.speculative_max_batch_size is None
    for i, question in enumerate(QUOTES):
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                    add_generation_prompt=True)
        prompt = list(engine.tokenizer(text)["input_ids"])
        run = run_all(engine, [prompt], [SamplingParams(max_new_tokens=MAX_NEW)])  # its answer, to its EOS
        assert ids(run["r0"]) == reference_greedy(folder, prompt, MAX_NEW), f"request {i}"
    stats = engine.stats()
    # the stats ride every step's frame to the frontend: they must survive the worker channel's codec
    assert decode_body(encode(Deltas(step=1, deltas=[], stats=stats))[4:]) == Deltas(step=1, deltas=[], stats=stats)
    assert stats["spec_accepted_tokens_total"] > 0 and stats["draft_gate"]["guesses_at_batch"]["1"] > 0
