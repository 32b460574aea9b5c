"""LoRA adapters on the host and in device slots: which are loaded, which slot each one holds, and
which request may join a batch.

Pure Python, no model: an adapter is an opaque payload (the engine's host arrays), named by the user,
identified by a `lora_id` that is new on every load (what in-flight requests and slots count), and
carrying a `cache_key` that the KV caches key on (`Req.namespace`; the engine's is a hash of the
adapter's files, so the same adapter shares KV under any name and a different one never does).

Two levels, as SGLang 0.5.23:
- Host (`--max-loaded-loras`): loading one more than the limit unloads the least recently used
  unpinned adapter (its name is then unknown; its running requests finish under it).
- Device slots 1..S-1 (slot 0 is the base model's zero adapter): a request gets its adapter's slot when
  admitted; a slot held by no admitted request is evicted least recently used first
  (`--lora-eviction-policy lru`) when another adapter needs one; a pinned adapter keeps its slot.
A batch holds at most `max_loras_per_batch` distinct adapters, the base model counting as one (SGLang's
rule): a request that would exceed it, or that finds no slot to take, waits (`can_admit`), rather than
evicting an adapter the running batch uses.

Thread safety: the HTTP threads load, unload and look names up while the engine thread admits and
finishes requests; one lock guards the tables.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict
from typing import Any, Hashable, Iterable

from jaxserve.core.errors import RequestError


class LoraNotFoundError(RequestError):
    """A name that is not (or no longer) loaded: a request naming it is refused (field `lora_path`)."""

    def __init__(self, message: str):
        super().__init__("lora_path", message)


@dataclasses.dataclass
class LoraRef:
    """One loaded adapter: its user name, path, whether it is pinned, and its unique id."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool
    payload: Any = dataclasses.field(repr=False, default=None)
    cache_key: Hashable = None


@dataclasses.dataclass(frozen=True)
class SlotWrite:
    """Slot `slot` must hold `payload` (None: zeros) before the next step runs."""

    slot: int
    lora_id: str | None
    payload: Any


class LoraSlots:
    """The adapter registry and the device slot table (see the module docstring).

    Args:
        num_slots: device slots including slot 0 (`--max-loras-per-batch` + 1).
        max_loras_per_batch: distinct adapters (the base model counting as one) in one batch.
        max_loaded_loras: adapters kept loaded on the host (None: no limit).
    """

    def __init__(self, num_slots: int, max_loras_per_batch: int, max_loaded_loras: int | None = None):
        if max_loaded_loras is not None and max_loaded_loras < max_loras_per_batch:
            raise ValueError(f"--max-loaded-loras ({max_loaded_loras}) must be >= --max-loras-per-batch ({max_loras_per_batch})")
        self.num_slots = num_slots
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded_loras = max_loaded_loras
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_name: OrderedDict[str, LoraRef] = OrderedDict()  # registered, least recently used first
        self._refs: dict[str, LoraRef] = {}  # lora_id -> ref, until unloaded and unused
        self._num_requests: dict[str, int] = {}  # lora_id -> unfinished requests
        self._slot_owner: list[str | None] = [None] * num_slots
        self._slot_users = [0] * num_slots  # admitted requests per slot
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, num_slots))
        self._writes: list[SlotWrite] = []

    # ---- the registry (any thread) --------------------------------------------------------------
    def register(self, name: str, path: str, payload: Any, pinned: bool = False,
                 cache_key: Hashable = None) -> tuple[LoraRef, list[str]]:
        """Load `name`; returns its ref and the names unloaded to stay within `max_loaded_loras`.
        `cache_key` (None: the lora_id) is what KV computed under it is keyed on (`cache_key_of`).

        Raises:
            ValueError: `name` is loaded already, or pinning it would leave no slot for unpinned ones.
        """
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            if pinned and sum(r.pinned for r in self._by_name.values()) + 1 > self.num_slots - 2:
                raise ValueError(f"at most {self.num_slots - 2} pinned LoRA adapters (one slot stays for the others)")
            lora_id = f"{name}#{next(self._ids)}"
            ref = LoraRef(lora_id, name, path, pinned, payload, lora_id if cache_key is None else cache_key)
            self._by_name[name] = ref
            self._refs[ref.lora_id] = ref
            self._num_requests.setdefault(ref.lora_id, 0)
            evicted = []
            while self.max_loaded_loras is not None and len(self._by_name) > self.max_loaded_loras:
                victim = next((r for r in self._by_name.values() if not r.pinned and r is not ref), None)
                if victim is None:
                    break
                self._unregister_locked(victim.lora_name)
                evicted.append(victim.lora_name)
            return ref, evicted

    def unregister(self, name: str) -> str:
        """Unload `name`: new requests may no longer name it; its unfinished requests run on under it
        (`is_in_use`), and its slot and host arrays are freed when the last one finishes.

        Raises:
            LoraNotFoundError: `name` is not loaded.
        """
        with self._lock:
            return self._unregister_locked(name)

    def _unregister_locked(self, name: str) -> str:
        ref = self._by_name.pop(name, None)
        if ref is None:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self._by_name)}")
        self._forget_if_unused(ref.lora_id)
        return ref.lora_id

    def cache_key_of(self, lora_id: str) -> Hashable:
        """The cache key of a loaded (or unloaded but still used) adapter."""
        with self._lock:
            return self._refs[lora_id].cache_key

    def is_in_use(self, lora_id: str) -> bool:
        """Whether requests under `lora_id` are unfinished."""
        with self._lock:
            return self._num_requests.get(lora_id, 0) > 0

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._by_name

    def loaded(self) -> dict[str, str]:
        """name -> path of every loaded adapter, in load order."""
        with self._lock:
            return {r.lora_name: r.lora_path for r in sorted(self._by_name.values(), key=lambda r: int(r.lora_id.rsplit("#", 1)[1]))}

    def acquire(self, name: str) -> str:
        """A new request under `name`: its lora_id (counted until `release`).

        Raises:
            LoraNotFoundError: `name` is not loaded.
        """
        with self._lock:
            ref = self._by_name.get(name)
            if ref is None:
                raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self._by_name)}")
            self._by_name.move_to_end(name)
            self._num_requests[ref.lora_id] += 1
            return ref.lora_id

    def release(self, lora_id: str) -> None:
        """A request under `lora_id` finished."""
        with self._lock:
            self._num_requests[lora_id] -= 1
            self._forget_if_unused(lora_id)

    def _forget_if_unused(self, lora_id: str) -> None:
        ref = self._refs.get(lora_id)
        if ref is None or self._num_requests.get(lora_id, 0) > 0 or self._by_name.get(ref.lora_name) is ref:
            return
        del self._refs[lora_id], self._num_requests[lora_id]
        for slot, owner in enumerate(self._slot_owner):
            if owner == lora_id:
                self._slot_owner[slot] = None
                self._slot_lru.move_to_end(slot, last=False)

    # ---- device slots (the engine thread) -------------------------------------------------------
    def can_admit(self, lora_id: str | None, active: Iterable[Hashable]) -> bool:
        """Whether a request under `lora_id` (None: the base model) may join a batch whose requests run
        under `active` (their lora_ids): the distinct count stays within `max_loras_per_batch`, and the
        adapter has a slot or can take one without evicting an adapter in use."""
        active = set(active)
        if len(active | {lora_id}) > self.max_loras_per_batch:
            return False
        if lora_id is None:
            return True
        with self._lock:
            return lora_id in self._slot_owner or self._free_slot() is not None

    def assign_slot(self, lora_id: str | None) -> int:
        """Give an admitted request its adapter's slot (0 for the base model), loading the adapter into
        a free or least recently used unused slot when it has none (a `SlotWrite`; `take_writes`).

        Raises:
            RuntimeError: no slot can be taken (call `can_admit` first).
        """
        if lora_id is None:
            return 0
        with self._lock:
            if lora_id in self._slot_owner:
                slot = self._slot_owner.index(lora_id)
            else:
                slot = self._free_slot()
                if slot is None:
                    raise RuntimeError(f"no LoRA slot free for {lora_id}")
                self._slot_owner[slot] = lora_id
                self._writes.append(SlotWrite(slot, lora_id, self._refs[lora_id].payload))
            self._slot_users[slot] += 1
            self._slot_lru.move_to_end(slot)
            return slot

    def leave_slot(self, slot: int) -> None:
        """A request admitted into `slot` left the batch (finished or retracted)."""
        if slot == 0:
            return
        with self._lock:
            self._slot_users[slot] -= 1
            assert self._slot_users[slot] >= 0, slot

    def take_writes(self) -> list[SlotWrite]:
        """The slot writes since the last call, in order (a slot written twice: both, the last wins)."""
        with self._lock:
            writes, self._writes = self._writes, []
            return writes

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used slot no admitted request uses whose adapter is
        not pinned; None when every slot is in use."""
        for slot in self._slot_lru:
            if self._slot_owner[slot] is None:
                return slot
        for slot in self._slot_lru:
            ref = self._refs.get(self._slot_owner[slot])
            if self._slot_users[slot] == 0 and not (ref is not None and ref.pinned and self._by_name.get(ref.lora_name) is ref):
                return slot
        return None

    def check_integrity(self, admitted: Iterable[tuple[str | None, int]]) -> None:
        """Assert the slot counts match the admitted requests' (lora_id, slot) pairs."""
        users = [0] * self.num_slots
        for lora_id, slot in admitted:
            if slot:
                users[slot] += 1
                assert self._slot_owner[slot] == lora_id, (slot, self._slot_owner[slot], lora_id)
        assert users[1:] == self._slot_users[1:], (users, self._slot_users)

    @property
    def num_slot_users(self) -> int:
        return sum(self._slot_users)
