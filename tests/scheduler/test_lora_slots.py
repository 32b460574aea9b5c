"""The LoRA registry and device slot table in pure Python: LRU eviction of unused slots, waiting when
every slot is in use, the per-batch adapter limit, pinning, --max-loaded-loras, and unloads that wait
for their requests."""

from __future__ import annotations

import pytest

from jaxserve.scheduler.lora_slots import LoraNotFoundError, LoraSlots


def loaded(slots: LoraSlots, *names: str, pinned=()) -> dict[str, str]:
    for name in names:
        slots.register(name, f"/{name}", payload=name.upper(), pinned=name in pinned)
    return {name: slots.acquire(name) for name in names}


def test_slots_fill_then_evict_the_least_recently_used_unused_one():
    slots = LoraSlots(num_slots=3, max_loras_per_batch=3)
    ids = loaded(slots, "a", "b", "c")
    sa, sb = slots.assign_slot(ids["a"]), slots.assign_slot(ids["b"])
    assert {sa, sb} == {1, 2}
    assert [(w.slot, w.payload) for w in slots.take_writes()] == [(sa, "A"), (sb, "B")]
    assert not slots.can_admit(ids["c"], [ids["a"], ids["b"]])  # both slots in use: c waits
    slots.leave_slot(sa)
    slots.leave_slot(sb)
    slots.assign_slot(ids["b"])  # b used again: a is now the least recently used
    slots.leave_slot(sb)
    assert slots.can_admit(ids["c"], [])
    assert slots.assign_slot(ids["c"]) == sa
    assert [(w.slot, w.payload) for w in slots.take_writes()] == [(sa, "C")]
    assert slots.assign_slot(ids["b"]) == sb and slots.take_writes() == []  # still resident: no write


def test_batch_limit_counts_the_base_model():
    slots = LoraSlots(num_slots=3, max_loras_per_batch=2)
    ids = loaded(slots, "a", "b")
    assert slots.can_admit(ids["a"], [None])
    assert not slots.can_admit(ids["b"], [None, ids["a"]])
    assert not slots.can_admit(None, [ids["a"], ids["b"]])
    assert slots.can_admit(None, [None, ids["a"]])


def test_pinned_adapter_keeps_its_slot():
    slots = LoraSlots(num_slots=3, max_loras_per_batch=2)
    ids = loaded(slots, "p", "a", "b", pinned=("p",))
    sp = slots.assign_slot(ids["p"])
    slots.leave_slot(sp)
    sa = slots.assign_slot(ids["a"])
    slots.leave_slot(sa)
    assert slots.assign_slot(ids["b"]) == sa  # a evicted, never the pinned p
    with pytest.raises(ValueError, match="pinned"):
        slots.register("q", "/q", "Q", pinned=True)  # one slot must stay for unpinned adapters


def test_unregister_refuses_new_requests_and_frees_after_the_last_one():
    slots = LoraSlots(num_slots=2, max_loras_per_batch=1)
    ids = loaded(slots, "a")
    slot = slots.assign_slot(ids["a"])
    slots.take_writes()
    lora_id = slots.unregister("a")
    assert lora_id == ids["a"] and slots.is_in_use(lora_id)
    with pytest.raises(LoraNotFoundError):
        slots.acquire("a")
    slots.leave_slot(slot)
    slots.release(lora_id)
    assert not slots.is_in_use(lora_id)
    again = loaded(slots, "a")["a"]
    assert again != lora_id  # a new load is a new adapter (the radix cache keys on the id)
    assert slots.assign_slot(again) == slot
    assert [w.payload for w in slots.take_writes()] == ["A"]


def test_max_loaded_loras_unloads_the_least_recently_used_unpinned():
    slots = LoraSlots(num_slots=3, max_loras_per_batch=2, max_loaded_loras=2)
    slots.register("a", "/a", "A", pinned=True)
    slots.register("b", "/b", "B")
    _, evicted = slots.register("c", "/c", "C")
    assert evicted == ["b"] and slots.loaded() == {"a": "/a", "c": "/c"}
    slots.acquire("c")
    _, evicted = slots.register("d", "/d", "D")
    assert evicted == ["c"] and not slots.has("c")  # unloaded; its running request finishes under it


def test_check_integrity_catches_a_lost_slot_user():
    slots = LoraSlots(num_slots=2, max_loras_per_batch=1)
    ids = loaded(slots, "a")
    slot = slots.assign_slot(ids["a"])
    slots.check_integrity([(ids["a"], slot)])
    with pytest.raises(AssertionError):
        slots.check_integrity([])
