"""Which LoRA adapter holds which slot: pinned while used, least recently used refilled, forgotten ones kept by
the sequences still running on them."""

from __future__ import annotations

from handlers.engine.execution.forward.lora import AdapterSlots


def test_slots_fill_pin_and_refill_least_recently_used() -> None:
    slots = AdapterSlots(2)
    assert slots.acquire("a") == (0, True)
    assert slots.acquire("b") == (1, True)
    assert slots.acquire("a") == (0, False)  # resident: no refill
    assert slots.acquire("c") is None  # both pinned
    slots.release(1)
    assert slots.acquire("c") == (1, True)  # b was the only unpinned one
    slots.release(0)
    slots.release(0)
    slots.release(1)
    slots.acquire("b")  # a is least recently used now (c was used after it)
    assert slots.resident == ["c", "b"]


def test_a_forgotten_adapter_keeps_its_slot_until_its_sequences_end() -> None:
    slots = AdapterSlots(1)
    assert slots.acquire("a") == (0, True)
    slots.forget("a")  # unregistered or replaced while a sequence runs on it
    assert slots.resident == []
    assert slots.acquire("a") is None  # its new weights need the slot the old ones still use
    slots.release(0)
    assert slots.acquire("a") == (0, True)  # refilled with the new weights
