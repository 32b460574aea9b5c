import threading
import time
from dataclasses import dataclass

import pytest

from jaxserve.constrained.backend import GrammarSpec, InvalidGrammarError
from jaxserve.constrained.grammar_queue import GrammarCompiler, GrammarQueue


@dataclass(frozen=True)
class FakeCompiled:
    spec: GrammarSpec


class FakeBackend:
    """Compiles instantly, except specs whose source starts with "slow", which wait for `release`."""

    name = "fake"
    vocab_size = 64

    def __init__(self) -> None:
        self.release = threading.Event()
        self.cache: dict[GrammarSpec, FakeCompiled] = {}
        self.num_compiles = 0

    def lookup(self, spec):
        return self.cache.get(spec)

    def compile(self, spec):
        self.num_compiles += 1
        if spec.source.startswith("slow"):
            assert self.release.wait(timeout=10)
        if spec.source.startswith("bad"):
            raise InvalidGrammarError(f"invalid regex: {spec.source}")
        self.cache[spec] = FakeCompiled(spec)
        return self.cache[spec]

    def new_matcher(self, compiled):
        raise NotImplementedError

    def fill_bitmask_batch(self, matchers, bitmask):
        raise NotImplementedError


def test_a_slow_grammar_does_not_block_a_cached_one():
    backend = FakeBackend()
    cached = GrammarSpec.regex("a+")
    backend.compile(cached)
    with GrammarCompiler(backend, num_workers=1) as compiler:
        slow = compiler.submit(GrammarSpec.regex("slow"))
        assert compiler.num_pending == 1
        fast = compiler.submit(cached)
        assert fast.done() and fast.result().spec == cached
        assert not slow.done()
        backend.release.set()
        assert slow.result(timeout=10).spec.source == "slow"


def test_same_spec_in_flight_compiles_once():
    backend = FakeBackend()
    with GrammarCompiler(backend, num_workers=2) as compiler:
        first = compiler.submit(GrammarSpec.regex("slow 1"))
        assert compiler.submit(GrammarSpec.regex("slow 1")) is first
        backend.release.set()
        first.result(timeout=10)
        assert backend.num_compiles == 1
        assert compiler.submit(GrammarSpec.regex("slow 1")).done()  # now a cache hit
    assert compiler.num_pending == 0


def test_grammar_queue_pops_ready_items_in_order_with_errors():
    backend = FakeBackend()
    with GrammarCompiler(backend, num_workers=2) as compiler:
        queue: GrammarQueue[str] = GrammarQueue(compiler)
        queue.add("r1", GrammarSpec.regex("slow r1"))
        queue.add("r2", GrammarSpec.regex("x+"))
        queue.add("r3", GrammarSpec.regex("bad ("))
        queue.add("r4", GrammarSpec.regex("slow r4"))
        assert queue.num_pending == 4
        deadline = time.monotonic() + 10
        ready = []
        while len(ready) < 2 and time.monotonic() < deadline:
            ready += queue.pop_ready()
            time.sleep(0.001)
        assert [r.item for r in ready] == ["r2", "r3"] and queue.num_pending == 2
        assert ready[0].compiled is not None and ready[0].error is None
        assert isinstance(ready[1].error, InvalidGrammarError) and "bad (" in str(ready[1].error)
        assert queue.remove("r4") and not queue.remove("r4") and queue.num_pending == 1
        backend.release.set()
        while queue.num_pending and time.monotonic() < deadline:
            ready = queue.pop_ready()
            time.sleep(0.001)
        assert [r.item for r in ready] == ["r1"] and ready[0].compiled.spec.source == "slow r1"


def test_grammar_queue_timeout():
    backend = FakeBackend()
    now = [0.0]
    with GrammarCompiler(backend, num_workers=1) as compiler:
        queue: GrammarQueue[str] = GrammarQueue(compiler, timeout_s=30, clock=lambda: now[0])
        queue.add("r1", GrammarSpec.regex("slow"))
        assert queue.pop_ready() == []
        now[0] = 31.0
        (ready,) = queue.pop_ready()
        assert ready.item == "r1" and isinstance(ready.error, TimeoutError) and queue.num_pending == 0
        backend.release.set()


def test_shutdown_cancels_queued_compiles():
    backend = FakeBackend()
    compiler = GrammarCompiler(backend, num_workers=1)
    queue: GrammarQueue[str] = GrammarQueue(compiler)
    queue.add("running", GrammarSpec.regex("slow a"))
    queue.add("queued", GrammarSpec.regex("slow b"))
    compiler.shutdown(wait=False)
    backend.release.set()
    deadline = time.monotonic() + 10
    ready = []
    while len(ready) < 2 and time.monotonic() < deadline:
        ready += queue.pop_ready()
        time.sleep(0.001)
    errors = {r.item: r.error for r in ready}
    assert errors["running"] is None and isinstance(errors["queued"], RuntimeError)
    with pytest.raises(RuntimeError):
        compiler.submit(GrammarSpec.regex("new"))


def test_real_backend_big_schema_does_not_block_a_cached_regex(backend):
    cached = GrammarSpec.regex(r"\d{3}")
    backend.compile(cached)
    big = {
        "type": "object",
        "properties": {
            f"field_{i}_{time.monotonic_ns()}": {
                "type": "object",
                "properties": {f"sub_{j}": {"type": "string", "pattern": f"[a-z]{{{j}}}[0-9]+"} for j in range(20)},
            }
            for i in range(40)
        },
    }
    with GrammarCompiler(backend, num_workers=1) as compiler:
        slow = compiler.submit(GrammarSpec.json_schema(big))
        start = time.perf_counter()
        fast = compiler.submit(cached)
        assert fast.done() and time.perf_counter() - start < 0.05
        assert fast.result() is backend.lookup(cached)
        compiled = slow.result(timeout=60)
        assert backend.lookup(GrammarSpec.json_schema(big)) is compiled


@pytest.mark.timeout(20)
def test_instant_compiles_do_not_deadlock():
    """A compile that finishes before submit returns runs the done-callback on the submitting thread."""
    backend = FakeBackend()
    with GrammarCompiler(backend, num_workers=2) as compiler:
        futures = [compiler.submit(GrammarSpec.regex(f"r{i}")) for i in range(200)]
        assert all(f.result(timeout=10).spec.source == f"r{i}" for i, f in enumerate(futures))
        deadline = time.monotonic() + 10
        while compiler.num_pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert compiler.num_pending == 0
