"""The multi-host step channel and fault logic in one process, over an in-memory stand-in for JAX's
coordination-service client (jaxserve/parallel/distributed.py): followers replay rank 0's runner calls
in order, read messages are deleted, a rank whose heartbeat stands still is named, and a flag that
differs is refused on both sides with both values."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jaxserve.parallel import distributed
from jaxserve.parallel.distributed import Cluster, DistributedStartError, RankLostError, Topology


class FakeClient:
    """The key-value calls of `jax._src.lib._jax.DistributedRuntimeClient` that distributed.py uses."""

    def __init__(self):
        self.store: dict[str, object] = {}
        self._cond = threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self._cond:
            self.store[key] = value
            self._cond.notify_all()

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self._cond:
            if not self._cond.wait_for(lambda: key in self.store, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.store[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_try_get(self, key):
        with self._cond:
            if key not in self.store:
                raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
            return str(self.store[key])

    def key_value_increment(self, key, increment):
        with self._cond:
            self.store[key] = int(self.store.get(key, 0)) + increment
            return self.store[key]

    def key_value_delete(self, key):
        with self._cond:
            self.store.pop(key, None)


def _cluster(client, rank: int, nnodes: int = 2, timeout_s: int = 5) -> Cluster:
    return Cluster(Topology(nnodes, rank, "127.0.0.1:1", timeout_s), client)


class RecordingRunner:
    def __init__(self):
        self.calls = []

    def run_batch(self, batch, key, input_logprobs):
        self.calls.append(("run_batch", batch["ids"].tolist(), key, input_logprobs))
        logits = f"logits of step {len(self.calls)}"
        return (logits, np.zeros(2)) if input_logprobs else logits

    def sample(self, logits, sampling, flags):
        self.calls.append(("sample", logits, sampling, flags))

    def read_pages(self, pages):
        self.calls.append(("read_pages", list(pages)))

    def copy_pages(self, src, dst):
        self.calls.append(("copy_pages", list(src), list(dst)))

    def write_pages(self, pages, k, v):
        self.calls.append(("write_pages", list(pages), k.shape, v.dtype.str))


def test_follower_replays_rank0_calls_in_order(monkeypatch):
    client = FakeClient()
    leader = _cluster(client, 0)
    ch = leader.channel
    # published, not run through step(): a sample's step deletes what the (here absent) followers read
    ch.publish("run_batch", {"ids": np.array([1, 2, 3])}, "bucket-a", False)
    ch.publish("sample", "sampling-1", "greedy")
    ch.publish("run_batch", {"ids": np.array([4])}, "bucket-b", True)
    ch.publish("sample", "sampling-2", "top-p")
    ch.publish("read_pages", [3, 4])
    ch.publish("copy_pages", [3], [7])
    ch.publish("write_pages", [5, 6], ((2, 2, 4), "<f4"), ((2, 2, 4), "<f4"))
    leader.close()  # publishes shutdown
    # the page contents would come through a collective; here rank 0's share is zeros of the template
    monkeypatch.setattr(distributed, "receive_shared", lambda *t: tuple(np.zeros(s, np.dtype(d)) for s, d in t))
    runner = RecordingRunner()
    assert distributed.follow(runner, _cluster(client, 1)) == 7
    assert runner.calls == [
        ("run_batch", [1, 2, 3], "bucket-a", False),
        ("sample", "logits of step 1", "sampling-1", "greedy"),
        ("run_batch", [4], "bucket-b", True),
        ("sample", "logits of step 3", "sampling-2", "top-p"),  # the logits of the follower's own forward
        ("read_pages", [3, 4]),
        ("copy_pages", [3], [7]),
        ("write_pages", [5, 6], (2, 2, 4), "<f4"),
    ]


def test_messages_are_deleted_once_a_sample_proves_every_rank_read_them():
    client = FakeClient()
    ch = _cluster(client, 0).channel
    with ch.step("run_batch", {"ids": np.array([1])}, "b", False):
        pass
    with ch.step("copy_pages", [1], [2]):
        pass
    with ch.step("run_batch", {"ids": np.array([2])}, "b", False):
        pass
    assert sorted(k for k in client.store if k.startswith("jaxserve/op/")) == [f"jaxserve/op/{i}" for i in range(3)]
    with ch.step("sample", "s", "f"):
        pass
    # up to the last forward (message 2) every rank has read; the sample itself may still be unread
    assert [k for k in client.store if k.startswith("jaxserve/op/")] == ["jaxserve/op/3"]


def test_a_rank_whose_heartbeat_stands_still_is_named(monkeypatch):
    client = FakeClient()
    leader = _cluster(client, 0, nnodes=3)
    client.key_value_increment("jaxserve/alive/1", 1)
    client.key_value_increment("jaxserve/alive/2", 1)
    assert leader.lost_ranks(stale_s=0.2) == []  # first look
    for _ in range(4):
        time.sleep(0.1)
        client.key_value_increment("jaxserve/alive/2", 1)  # rank 2 beats, rank 1 is silent
        lost = leader.lost_ranks(stale_s=0.2)
    assert lost == [1]

    monkeypatch.setattr(distributed, "FAILED_STEP_STALE_S", 0.2)
    with pytest.raises(RankLostError, match=r"rank 1 of --nnodes 3 stopped: .*\(Gloo all-reduce failed\)") as e:
        with leader.channel.step("run_batch", {"ids": np.array([1])}, "b", False):
            raise ValueError("Gloo all-reduce failed")
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(RankLostError):  # every later call fails at once
        with leader.channel.step("sample", "s", "f"):
            pass


def test_a_failure_with_every_rank_alive_propagates_unchanged(monkeypatch):
    client = FakeClient()
    leader = _cluster(client, 0)
    monkeypatch.setattr(distributed, "LOSS_REPORT_WAIT_S", 0.3)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            client.key_value_increment("jaxserve/alive/1", 1)

    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(ValueError, match="a bug"):
            with leader.channel.step("run_batch", {"ids": np.array([1])}, "b", False):
                raise ValueError("a bug")
    finally:
        stop.set()
        t.join()
    assert leader.lost is None


def test_a_different_flag_is_refused_on_both_ranks_with_both_values():
    client = FakeClient()
    follower_error = []

    def follower():
        try:
            _cluster(client, 1).check_same_config("flags", {"--page-size": 16, "--tp-size": 2})
        except DistributedStartError as e:
            follower_error.append(str(e))

    t = threading.Thread(target=follower)
    t.start()
    with pytest.raises(DistributedStartError) as e:
        _cluster(client, 0).check_same_config("flags", {"--page-size": 8, "--tp-size": 2})
    t.join(10)
    expected = "rank 1 was started with another configuration than rank 0: --page-size: rank 0 has 8, rank 1 has 16"
    assert str(e.value) == expected and follower_error == [expected]


def test_same_config_passes_and_a_silent_rank_times_out_naming_it():
    client = FakeClient()
    t = threading.Thread(target=lambda: _cluster(client, 1).check_same_config("flags", {"--page-size": 8}))
    t.start()
    _cluster(client, 0).check_same_config("flags", {"--page-size": 8})
    t.join(10)
    with pytest.raises(DistributedStartError, match="rank 0: no answer from rank 1 within --dist-timeout 1 s"):
        _cluster(client, 0, timeout_s=1).check_same_config("engine", {"KV pool pages": 129})


def test_short_cause_keeps_each_part_of_a_nested_xla_error_once():
    nested = ("INTERNAL: Error dispatching computation: Error dispatching computation: Error dispatching computation: "
              "Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
              "[127.0.0.1]:61146\nsecond line")
    assert distributed.short_cause(RuntimeError(nested)) == (
        "INTERNAL: Error dispatching computation: Gloo all-reduce failed: Connection closed by peer [127.0.0.1]:61146")


def test_a_lost_rank_is_named_once_with_the_cause_once(monkeypatch):
    """tp 4 over 2 processes of 2 devices: XLA repeats "Error dispatching computation" per device; the
    500's message (the RankLostError) had it ~8 times."""
    client = FakeClient()
    leader = _cluster(client, 0)
    client.key_value_increment("jaxserve/alive/1", 1)
    monkeypatch.setattr(distributed, "FAILED_STEP_STALE_S", 0.2)
    cause = "INTERNAL: " + "Error dispatching computation: " * 8 + "Gloo all-reduce failed: Connection closed by peer"
    with pytest.raises(RankLostError) as e:
        with leader.channel.step("run_batch", {"ids": np.array([1])}, "b", False):
            raise RuntimeError(cause)
    message = str(e.value)
    assert message.count("Error dispatching computation") == 1 and message.count("rank 1") == 1, message


def test_a_follower_that_failed_its_own_step_is_not_named(monkeypatch):
    """3 ranks, rank 2 killed: rank 1's collective fails too and it exits, so both heartbeats stop;
    rank 1 reported its failure, so rank 0 names rank 2 only (it named "rank 1, 2")."""
    client = FakeClient()
    leader = _cluster(client, 0, nnodes=3)
    for rank in (1, 2):
        client.key_value_increment(f"jaxserve/alive/{rank}", 1)
    _cluster(client, 1, nnodes=3).report_failure("a step failed")
    monkeypatch.setattr(distributed, "FAILED_STEP_STALE_S", 0.2)
    with pytest.raises(RankLostError, match=r"^rank 2 of --nnodes 3 stopped"):
        with leader.channel.step("run_batch", {"ids": np.array([1])}, "b", False):
            raise RuntimeError("Gloo all-reduce failed")
    # every silent rank reported a failure of its own: all of them are named
    client2 = FakeClient()
    leader2 = _cluster(client2, 0, nnodes=3)
    for rank in (1, 2):
        client2.key_value_increment(f"jaxserve/alive/{rank}", 1)
        _cluster(client2, rank, nnodes=3).report_failure("a step failed")
    monkeypatch.setattr(distributed, "LOSS_REPORT_WAIT_S", 0.5)
    with pytest.raises(RankLostError, match=r"^rank 1, 2 of --nnodes 3 stopped"):
        with leader2.channel.step("run_batch", {"ids": np.array([1])}, "b", False):
            raise RuntimeError("Gloo all-reduce failed")


def test_the_watchdog_reports_only_a_loss_no_step_reported(monkeypatch):
    """A loss a failed step found is logged by the engine loop's death path; the watchdog used to log
    it (and end the engine) a second time."""
    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(distributed, "FAILED_STEP_STALE_S", 0.2)
    client = FakeClient()
    leader = _cluster(client, 0, timeout_s=1)
    client.key_value_increment("jaxserve/alive/1", 1)
    with pytest.raises(RankLostError):
        with leader.channel.step("run_batch", {"ids": np.array([1])}, "b", False):
            raise RuntimeError("Gloo all-reduce failed")
    reports = []
    leader.watch(on_lost=reports.append)
    time.sleep(0.5)
    assert reports == []
    # idle: only the watchdog can notice, and it reports once
    idle = _cluster(FakeClient(), 0, timeout_s=1)
    idle.client.key_value_increment("jaxserve/alive/1", 1)
    idle.watch(on_lost=reports.append)
    deadline = time.monotonic() + 5
    while not reports and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert len(reports) == 1 and "rank 1 of --nnodes 2 stopped" in str(reports[0])
    leader.close()
    idle.close()


def test_an_idle_rank0_finds_a_silent_rank_by_the_heartbeat_timeout_not_dist_timeout(monkeypatch):
    """--dist-timeout 300 (the default) bounds start-up only: an idle rank 0's watchdog names a follower
    whose heartbeat stood still for HEARTBEAT_TIMEOUT_S (here 0.3 s), and a shorter --dist-timeout
    shortens it."""
    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(distributed, "HEARTBEAT_TIMEOUT_S", 0.3)
    assert Topology(2, 0, "127.0.0.1:1", 300).heartbeat_timeout_s == 0.3
    assert Topology(2, 0, "127.0.0.1:1", 4).heartbeat_timeout_s == min(4, distributed.HEARTBEAT_TIMEOUT_S)
    leader = _cluster(FakeClient(), 0, nnodes=3, timeout_s=300)
    leader.client.key_value_increment("jaxserve/alive/1", 1)
    leader.client.key_value_increment("jaxserve/alive/2", 1)
    reports = []
    leader.watch(on_lost=reports.append)
    deadline = time.monotonic() + 10  # far below --dist-timeout
    while not reports and time.monotonic() < deadline:
        leader.client.key_value_increment("jaxserve/alive/1", 1)  # rank 1 beats, rank 2 is silent
        time.sleep(0.05)
    leader.close()
    assert [str(e) for e in reports] == [
        "rank 2 of --nnodes 3 stopped: the model cannot run without it (no heartbeat for 0.3 s)"]


def test_after_a_lost_rank_rank0_tells_the_followers_why_it_stops(monkeypatch):
    """The followers may be blocked in a collective that waits for the lost rank, so not reading the
    step channel: rank 0 leaves its reason where their heartbeat threads look."""
    monkeypatch.setattr(distributed, "STOP_NOTICE_S", 0)
    client = FakeClient()
    leader = _cluster(client, 0, nnodes=3)
    assert leader.lost_error(wait_s=5, stale_s=0) is not None  # no follower ever beat: both lost
    leader.close()
    assert "jaxserve/op/0" not in client.store  # no shutdown message: nobody might read it
    assert client.store["jaxserve/failed/0"].startswith("rank 1, 2 of --nnodes 3 stopped")


def test_rank0_refuses_to_start_when_a_follower_gave_up_waiting_for_it():
    """Rank 0 loaded for longer than --dist-timeout: the follower had given up (and exited) but rank 0
    read its configuration from the store and printed its ready line."""
    client = FakeClient()
    follower_error = []

    def follower():
        try:
            _cluster(client, 1, timeout_s=1).check_same_config("engine", {"KV pool pages": 129})
        except DistributedStartError as e:
            follower_error.append(str(e))

    t = threading.Thread(target=follower)
    t.start()
    t.join(10)  # the follower gives up before rank 0 gets there
    assert follower_error and "no answer from rank 0" in follower_error[0]
    with pytest.raises(DistributedStartError, match=r"rank 1 of --nnodes 2 gave up before rank 0 was ready: "
                                                    r"rank 1: no answer from rank 0"):
        _cluster(client, 0, timeout_s=1).check_same_config("engine", {"KV pool pages": 129})


def test_a_joined_rank_that_heartbeats_is_waited_for_past_the_timeout(monkeypatch):
    """--dist-timeout 20: rank 0 finished compiling first and gave up 20 s later waiting for rank 1's
    configuration, naming it missing, while rank 1 was alive and still compiling."""
    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(distributed, "START_POLL_MS", 50)
    client = FakeClient()
    leader, follower = _cluster(client, 0, timeout_s=1), _cluster(client, 1, timeout_s=1)
    leader.start_heartbeat()
    follower.start_heartbeat()
    errors = []

    def slow_follower():
        time.sleep(2.5)  # compiling: longer than --dist-timeout, beating all along
        try:
            follower.check_same_config("engine", {"KV pool pages": 129})
        except DistributedStartError as e:
            errors.append(e)

    t = threading.Thread(target=slow_follower)
    t.start()
    leader.check_same_config("engine", {"KV pool pages": 129})
    t.join(10)
    assert errors == []
    # the other way round: the follower waits for a rank 0 that is still compiling
    t = threading.Thread(target=lambda: follower.check_same_config("flags", {"--page-size": 8}))
    t.start()
    time.sleep(2.5)
    leader.check_same_config("flags", {"--page-size": 8})
    t.join(10)
    assert not t.is_alive()
    leader.close()
    follower._closed.set()


def test_a_rank_that_reported_a_failure_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(distributed, "START_POLL_MS", 50)
    client = FakeClient()
    client.key_value_increment("jaxserve/alive/1", 1)
    _cluster(client, 1, timeout_s=30).report_failure("out of memory while compiling")
    start = time.monotonic()
    with pytest.raises(DistributedStartError, match="rank 1 gave up: out of memory while compiling"):
        _cluster(client, 0, timeout_s=30).check_same_config("engine", {"KV pool pages": 129})
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("addr, bind", [("127.0.0.1:29500", "127.0.0.1:29500"), ("10.0.0.1:1234", "10.0.0.1:1234"),
                                        ("[::1]:29500", "[::1]:29500"), ("node0:29500", None)])
def test_the_coordinator_binds_to_an_ip_given_in_dist_init_addr(addr, bind):
    assert Topology(2, 0, addr, 5).bind_address == bind
