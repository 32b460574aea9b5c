"""One model over several processes: jax.distributed start-up, the configuration check
between ranks, the step channel from rank 0 to the other ranks (its cost: D-34), and the follower loop.

Rank 0 is the only controller: it runs the HTTP server, the tokenizer, the scheduler, the radix tree
and the release policy. Every other rank (a follower) builds the same engine (same weights, pool and
compiled programs) but never schedules: it only replays, in order, the device programs rank 0 runs,
so every collective of the sharded step has all its processes. The unit replayed is one method call
of `jaxserve.runner.model_runner.ModelRunner` (`run_batch`, `sample`, `read_pages`, `write_pages`,
`copy_pages`): rank 0's runner sends each call's host inputs through `StepChannel.step` before running
it, and `follow` makes the same call on the follower's runner.

Channel: JAX's own distributed runtime, no sockets of ours. Each call is one pickled message in the
coordination service's key-value store under `jaxserve/op/<seq>` (`key_value_set_bytes`, read with
`blocking_key_value_get_bytes`); page contents written to the pool (a recall from the host tier)
travel through the collectives instead (`multihost_utils.broadcast_one_to_all`), not through the store.
Messages are deleted once every rank has provably read them: a sampled step's result reached rank 0,
so every rank ran the forward before it (its all-reduces need them all).

Faults (nothing hangs):
- start-up: a rank missing after `--dist-timeout` seconds ends the process with an error naming the
  ranks it waited for (JAX itself would abort with no name: our timer exits first); once joined, every
  rank heartbeats, and a rank waiting for another's configuration or verdict waits as long as that
  rank's heartbeat moves (compiling may outlast `--dist-timeout`), so the timeout bounds silence;
- a rank started with another configuration is refused by rank 0 (`check_same_config`): both exit
  with the flag and both values; a follower that gave up waiting for rank 0's verdict (rank 0 loaded
  for longer than `--dist-timeout`) reports it, and rank 0 refuses to start instead of printing its
  ready line (every follower acknowledges the verdict);
- a rank that dies while serving: its collective fails on the other ranks (gloo: connection reset)
  and its heartbeat counter in the store (`jaxserve/alive/<rank>`, bumped every 0.5 s by a follower
  thread) stands still; rank 0 then raises `RankLostError` naming the rank, which the server treats
  as engine death (500s, exit 1). An idle rank 0 notices through its watchdog within
  `HEARTBEAT_TIMEOUT_S` (10 s; `--dist-timeout` when shorter), as does a busy one whose step waits for
  the lost rank without failing (a collective with no timeout of its own).
  A surviving follower whose own collective failed writes `jaxserve/failed/<rank>` and exits with one
  line (`report_failure`); rank 0 then names only the rank that stopped on its own, not the followers
  that exited because of it. The loss is reported once: by the failed step or, when none ran, by the
  watchdog; a cause is shortened to one line without XLA's repeated prefixes (`short_cause`).
  (`get_live_nodes` is no probe: it blocks until every live task calls it.) JAX's
  `jax_enable_recoverability` is turned on so that the coordination service does not terminate every
  other process when one dies;
- rank 0 stops: on SIGTERM it sends `shutdown` and the followers exit 0; after a lost rank it writes
  `jaxserve/failed/0`, which each follower's heartbeat thread reads (its main thread may be blocked in
  a collective with the lost rank) and exits 1 with one line; if rank 0 dies, a follower exits when its
  heartbeat finds the coordinator gone (a closed connection), or JAX's client ends it when the
  coordinator stops answering its own heartbeats for `JAX_HEARTBEAT_TIMEOUT_S` (a halted host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import pickle
import re
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

logger = logging.getLogger(__name__)

# JAX's own initialization_timeout default (jax.distributed.initialize, 0.10.2); SGLang's --dist-timeout
# defaults to None (torch.distributed's default) as ours does.
DEFAULT_DIST_TIMEOUT_S = 300
KEY_PREFIX = "jaxserve/"
# How long a follower's read of the next message blocks before it polls again (an idle server sends none).
FOLLOWER_POLL_MS = 2000
# Every rank bumps a counter in the store this often (`Cluster.start_heartbeat`).
HEARTBEAT_S = 0.5
# Once serving, rank 0 counts a rank lost when its counter stood still this long (--dist-timeout when
# shorter; 2 s right after a failed collective, to name the rank that caused it): 20 missed beats. The
# beat is a Python thread that runs while steps and compiles release the GIL, so 10 s of silence is a
# stopped process, not a slow one. It bounds how long an idle rank 0, which runs no step that could
# fail, serves on with a dead follower. Start-up waits keep --dist-timeout (a load may hold the GIL).
HEARTBEAT_TIMEOUT_S = 10.0
# JAX's own heartbeat (C++ threads, every rank to the coordination service): a follower whose coordinator
# stopped answering without closing the connection (its host halted) is ended by JAX's client after this
# (JAX's default: 100 s); a coordinator that exits closes the connection, and the follower exits at once.
JAX_HEARTBEAT_TIMEOUT_S = 30
START_POLL_MS = 500  # a start-up wait looks at the awaited rank's heartbeat this often
FAILED_STEP_STALE_S = 2.0
STOP_NOTICE_S = 3 * HEARTBEAT_S  # rank 0's wait, after a lost rank, for the followers to read why it stops
LOSS_REPORT_WAIT_S = 3.0


class DistributedStartError(RuntimeError):
    """The processes could not form the cluster (a rank missing, a refused configuration)."""


class RankLostError(RuntimeError):
    """A rank stopped while the cluster was serving (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process stands: rank `node_rank` of `nnodes` around the coordinator at `coordinator`."""

    nnodes: int
    node_rank: int
    coordinator: str
    timeout_s: int

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def heartbeat_timeout_s(self) -> float:
        """Seconds a joined rank's heartbeat may stand still, once serving, before it counts as lost:
        `HEARTBEAT_TIMEOUT_S`, or `--dist-timeout` when shorter."""
        return min(float(self.timeout_s), HEARTBEAT_TIMEOUT_S)

    @property
    def bind_address(self) -> str | None:
        """Where rank 0's coordination service listens: the `--dist-init-addr` host when it is an IP
        address (127.0.0.1 stays on loopback), else None: JAX's `[::]:PORT`, every interface, since a
        host name may resolve locally to another address than the one the other ranks reach (Debian
        maps its own name to 127.0.1.1)."""
        host, _, _ = self.coordinator.rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return None
        return self.coordinator


def _key(*parts: object) -> str:
    return KEY_PREFIX + "/".join(str(p) for p in parts)


_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|h|cpp):\d+\] ")


def short_cause(e: BaseException | str) -> str:
    """The first line of an error's message without source locations and repeated prefixes: XLA
    nests a failed collective once per device ("INTERNAL: Error dispatching computation: Error
    dispatching computation: ... Gloo all-reduce failed: [external/gloo/...pair.cc:547] Connection
    closed by peer") and this keeps each part once."""
    lines = str(e).splitlines()
    parts = _SOURCE_LOCATION.sub("", lines[0] if lines else "").split(": ")
    kept = [p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]]
    return ": ".join(kept)


def _others(nnodes: int) -> str:
    ranks = list(range(1, nnodes))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def _others_of(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def initialize(topology: Topology) -> "Cluster":
    """`jax.distributed.initialize` for this rank; call it before anything touches a device.

    A rank missing after `topology.timeout_s` seconds ends the process (status 1) with a message
    naming the ranks waited for: JAX would abort it with no name at its own timeout, set a few
    seconds later.
    """
    t = topology
    waited = _others(t.nnodes) if t.is_leader else "rank 0 (the coordinator)"
    joined = threading.Event()

    def give_up() -> None:
        if not joined.is_set():
            print(f"jaxserve: cannot start: rank {t.node_rank} of --nnodes {t.nnodes}: {waited} did not join at "
                  f"{t.coordinator} within --dist-timeout {t.timeout_s} s", flush=True)
            os._exit(1)

    timer = threading.Timer(t.timeout_s, give_up)
    timer.daemon = True
    timer.start()
    # a lost task is reported to the others (get_live_nodes, failed collectives) instead of terminating them
    jax.config.update("jax_enable_recoverability", True)
    # JAX's preemption notifier would catch SIGTERM (and so keep a follower alive): the server handles it
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(
            t.coordinator, t.nnodes, t.node_rank,
            initialization_timeout=t.timeout_s + 5,
            heartbeat_timeout_seconds=min(t.timeout_s, JAX_HEARTBEAT_TIMEOUT_S),
            shutdown_timeout_seconds=min(t.timeout_s, 10), coordinator_bind_address=t.bind_address,
        )
    finally:
        joined.set()
        timer.cancel()
    logger.info("jax.distributed: rank %d of %d joined at %s; %d devices (%d here)",
                t.node_rank, t.nnodes, t.coordinator, jax.device_count(), jax.local_device_count())
    return Cluster(t, _client())


def _client():
    from jax._src import distributed

    return distributed.global_state.client


class Cluster:
    """The joined processes: the config check, the step channel (rank 0) and liveness."""

    def __init__(self, topology: Topology, client):
        self.topology = topology
        self.client = client
        self.channel = StepChannel(self) if topology.is_leader else None
        self._lost: RankLostError | None = None
        self._lost_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()
        self._beats: dict[int, tuple[str | None, float]] = {}  # rank -> (last counter seen, when)
        self._beats_lock = threading.Lock()

    def check_devices(self, tp_size: int) -> None:
        """`--tp-size` counts the devices of every process together (as sglang-jax does).

        Raises:
            DistributedStartError: `tp_size` is not the global device count (both numbers named).
        """
        num_devices, num_local = jax.device_count(), jax.local_device_count()
        if tp_size != num_devices:
            raise DistributedStartError(
                f"--tp-size {tp_size} must equal the devices of all --nnodes {self.topology.nnodes} processes "
                f"together: {num_devices} ({num_local} per process)")

    def check_same_config(self, stage: str, fields: Mapping[str, object]) -> None:
        """Compare this rank's `fields` (flag or quantity name -> value) with rank 0's; rank 0 answers
        every follower, then both sides raise on a difference. Each side waits while the other rank's
        heartbeat moves (its start-up, compiling, may take longer than `--dist-timeout`) and gives up
        after `--dist-timeout` seconds without one, or at once when that rank reported a failure.

        Raises:
            DistributedStartError: a difference, naming the field, rank 0's value and the follower's.
        """
        t = self.topology
        mine = {k: str(v) for k, v in fields.items()}
        if not t.is_leader:
            self.client.key_value_set(_key("config", stage, t.node_rank), json.dumps(mine))
            try:
                verdict = self._get(_key("verdict", stage, t.node_rank), 0, "rank 0 (the coordinator)")
            except DistributedStartError as e:
                self.report_failure(str(e))  # so that a rank 0 still loading does not report ready
                raise
            if verdict != "ok":
                raise DistributedStartError(verdict)
            self.client.key_value_set(_key("ack", stage, t.node_rank), "ok")
            return
        refusals = []
        for rank in range(1, t.nnodes):
            theirs = json.loads(self._get(_key("config", stage, rank), rank, f"rank {rank}"))
            diffs = [f"{name}: rank 0 has {mine[name]}, rank {rank} has {theirs.get(name)}"
                     for name in mine if theirs.get(name) != mine[name]]
            verdict = "ok"
            if diffs:
                verdict = f"rank {rank} was started with another configuration than rank 0: {'; '.join(diffs)}"
            self.client.key_value_set(_key("verdict", stage, rank), verdict)
            if diffs:
                refusals.append(verdict)
        if refusals:
            raise DistributedStartError("; ".join(refusals))
        self._wait_acks(stage)

    def _wait_acks(self, stage: str) -> None:
        """Rank 0: every follower read its "ok" verdict of `stage`, none gave up waiting for it."""
        t = self.topology
        deadline = time.monotonic() + t.timeout_s
        waiting = set(range(1, t.nnodes))
        while waiting:
            for rank in sorted(waiting):
                if (reason := self._try_get(_key("failed", rank))) is not None:
                    raise DistributedStartError(f"rank {rank} of --nnodes {t.nnodes} gave up before rank 0 was ready: {reason}")
                if self._try_get(_key("ack", stage, rank)) is not None:
                    waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                raise DistributedStartError(
                    f"rank 0: {_others_of(sorted(waiting))} did not confirm rank 0's configuration check within "
                    f"--dist-timeout {t.timeout_s} s")
            if waiting:
                time.sleep(0.05)

    def _try_get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND
            return None

    def report_failure(self, reason: str) -> None:
        """Say why this rank stops (before it exits). A follower's note keeps rank 0 from naming it as
        the rank that was lost or reporting ready while it is gone; rank 0's ends the followers
        (`start_heartbeat`). Best effort: the coordinator may be gone."""
        with contextlib.suppress(Exception):
            self.client.key_value_set(_key("failed", self.topology.node_rank), reason)

    def _get(self, key: str, rank: int, who: str) -> str:
        """The value of `key`, which `rank` (named `who`) writes, waiting while `rank` heartbeats: a
        joined rank that is alive is still starting, not missing, so `--dist-timeout` bounds its silence,
        not its compile time. A rank that never beat is silent from the first look.

        Raises:
            DistributedStartError: `--dist-timeout` seconds without a heartbeat of `rank`, a failure it
                reported, or the coordination service gone.
        """
        t = self.topology
        seen, since = None, time.monotonic()
        while True:
            try:
                return self.client.blocking_key_value_get(key, START_POLL_MS)
            except Exception as e:  # noqa: BLE001 - the runtime raises its own status errors
                cause = e
            if "DEADLINE_EXCEEDED" not in str(cause):  # UNAVAILABLE: the coordinator is gone
                break
            if rank != t.node_rank and (reason := self._try_get(_key("failed", rank))) is not None:
                raise DistributedStartError(f"rank {t.node_rank}: {who} gave up: {reason}")
            beat, now = self._try_get(_key("alive", rank)), time.monotonic()
            if beat != seen:
                seen, since = beat, now
            elif now - since > t.timeout_s:
                break
        raise DistributedStartError(
            f"rank {t.node_rank}: no answer from {who} within --dist-timeout {t.timeout_s} s "
            f"({short_cause(cause)})") from None

    @property
    def lost(self) -> RankLostError | None:
        """The `RankLostError` once a rank was found lost, else None."""
        return self._lost

    def start_heartbeat(self) -> None:
        """Bump `jaxserve/alive/<rank>` every `HEARTBEAT_S` from a daemon thread, from the join on (every
        rank: a start-up wait counts the awaited rank's silence). A follower's thread exits the process
        (status 1, one line) when the coordinator no longer answers or rank 0 wrote why it stops (`close`
        after a lost rank): its main thread may be blocked in a collective that waits for the lost rank."""
        t = self.topology
        key = _key("alive", t.node_rank)

        def run() -> None:
            while not self._closed.wait(HEARTBEAT_S):
                try:
                    self.client.key_value_increment(key, 1)
                except Exception as e:  # noqa: BLE001 - the coordination service is gone
                    if t.is_leader:  # its own service is shutting down with the process
                        return
                    print(f"jaxserve: rank {t.node_rank}: rank 0 (the coordinator) went away "
                          f"({short_cause(e)}): exiting", flush=True)
                    os._exit(1)
                if not t.is_leader and (reason := self._try_get(_key("failed", 0))) is not None:
                    print(f"jaxserve: rank {t.node_rank} of --nnodes {t.nnodes}: rank 0 stopped ({reason}): "
                          "exiting with status 1", flush=True)
                    os._exit(1)

        self.client.key_value_increment(key, 1)
        threading.Thread(target=run, name="jaxserve-heartbeat", daemon=True).start()

    def lost_ranks(self, stale_s: float) -> list[int]:
        """Followers whose heartbeat counter has not moved for `stale_s` seconds (rank 0's clock; a
        rank that never beat counts from the first look)."""
        now, lost = time.monotonic(), []
        with self._beats_lock:
            for rank in range(1, self.topology.nnodes):
                try:
                    value = self.client.key_value_try_get(_key("alive", rank))
                except Exception:  # noqa: BLE001 - NOT_FOUND before its first beat
                    value = None
                seen, since = self._beats.get(rank, (None, now))
                if value != seen or rank not in self._beats:
                    self._beats[rank] = (value, now)
                elif now - since > stale_s:
                    lost.append(rank)
        return lost

    def lost_error(self, cause: BaseException | None = None, wait_s: float = 0.0,
                   stale_s: float | None = None) -> RankLostError | None:
        """A `RankLostError` naming the lost ranks (heartbeats still for `stale_s`, default
        `Topology.heartbeat_timeout_s`), polling up to `wait_s` seconds; None if none is. A follower that reported
        its own failed step (`report_failure`) is named only when no other rank stopped."""
        return self._find_lost(cause, wait_s, stale_s)[0]

    def _find_lost(self, cause: BaseException | None = None, wait_s: float = 0.0,
                   stale_s: float | None = None) -> tuple[RankLostError | None, bool]:
        """(`lost_error`'s result, whether this call is the one that found the loss)."""
        if self._lost is not None:
            return self._lost, False
        stale_s = self.topology.heartbeat_timeout_s if stale_s is None else stale_s
        deadline = time.monotonic() + wait_s
        while True:
            stale = self.lost_ranks(stale_s)
            lost = [r for r in stale if self._try_get(_key("failed", r)) is None]
            if lost or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        lost = lost or stale  # every silent rank failed a step itself: name them all
        if not lost:
            return None, False
        why = f" ({short_cause(cause)})" if cause is not None else f" (no heartbeat for {stale_s:g} s)"
        error = RankLostError(f"rank {', '.join(map(str, lost))} of --nnodes {self.topology.nnodes} stopped: "
                              f"the model cannot run without it{why}")
        with self._lost_lock:
            if self._lost is not None:
                return self._lost, False
            self._lost = error
        return error, True

    def watch(self, on_lost: Callable[[RankLostError], None]) -> None:
        """Rank 0: call `on_lost(error)` once, from a watchdog thread, when the watchdog is first to
        find that a rank left the cluster (while idle, when no step would notice); a loss a failed
        step found is that step's to report (the engine loop's death path logs it, once)."""

        def run() -> None:
            while not self._closed.wait(HEARTBEAT_S):
                error, is_first = self._find_lost()
                if error is not None:
                    if is_first:
                        on_lost(error)
                    return

        self._watchdog = threading.Thread(target=run, name="jaxserve-rank-watchdog", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        """Rank 0: tell the followers to exit; stop the watchdog. After a lost rank the `shutdown`
        message might never be read (a follower may be blocked in a collective that waits for the
        lost rank): rank 0 writes the loss as its own failure instead, which each follower's heartbeat
        thread reads within `HEARTBEAT_S`, and waits `STOP_NOTICE_S` for them to read it."""
        self._closed.set()
        if self.channel is None:
            return
        if self._lost is None:
            with contextlib.suppress(Exception):
                self.channel.publish("shutdown")
            return
        self.report_failure(str(self._lost))
        time.sleep(STOP_NOTICE_S)


class StepChannel:
    """Rank 0's side of the channel: one message per device program, in order (module docstring)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.client = cluster.client
        self.num_messages = 0
        self.num_bytes = 0
        self._last_forward = -1
        self._num_deleted = 0

    def publish(self, op: str, *args: Any) -> None:
        """Send `op(*args)` to every follower (numpy arrays and plain Python values)."""
        data = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.client.key_value_set_bytes(_key("op", self.num_messages), data)
        if op == "run_batch":
            self._last_forward = self.num_messages
        self.num_messages += 1
        self.num_bytes += len(data)

    @contextlib.contextmanager
    def step(self, op: str, *args: Any) -> Iterator[None]:
        """Publish `op(*args)`, then run rank 0's own call in the `with` body.

        Raises:
            RankLostError: a rank was lost before, or the body failed because one was (the cause is
                chained); any other failure propagates unchanged.
        """
        if self.cluster.lost is not None:
            raise self.cluster.lost
        self.publish(op, *args)
        try:
            yield
        except Exception as e:
            lost = self.cluster.lost_error(e, wait_s=LOSS_REPORT_WAIT_S, stale_s=FAILED_STEP_STALE_S)
            if lost is not None:
                raise lost from e
            raise
        if op == "sample":
            self._delete_read()

    def share(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """Rank 0's arrays on every rank (a collective: each follower calls `receive_shared`)."""
        from jax.experimental import multihost_utils

        return tuple(np.asarray(a) for a in multihost_utils.broadcast_one_to_all(tuple(arrays)))

    def _delete_read(self) -> None:
        # rank 0 holds a sampled result of the last forward: every rank ran that forward, so read it
        # and everything before it
        for seq in range(self._num_deleted, self._last_forward + 1):
            with contextlib.suppress(Exception):
                self.client.key_value_delete(_key("op", seq))
        self._num_deleted = max(self._num_deleted, self._last_forward + 1)


def receive_shared(*templates: tuple[tuple[int, ...], str]) -> tuple[np.ndarray, ...]:
    """A follower's side of `StepChannel.share`: arrays of the given (shape, dtype) from rank 0."""
    from jax.experimental import multihost_utils

    zeros = tuple(np.zeros(shape, np.dtype(dtype)) for shape, dtype in templates)
    return tuple(np.asarray(a) for a in multihost_utils.broadcast_one_to_all(zeros))


def follow(runner, cluster: Cluster) -> int:
    """The follower loop: replay rank 0's runner calls on `runner` (a `ModelRunner` without a channel)
    until rank 0 sends `shutdown` (returns the number of calls replayed).

    Raises:
        RankLostError: the coordinator went away between messages (JAX usually ends the process first).
    """
    client, seq, logits = cluster.client, 0, None
    while True:
        try:
            data = client.blocking_key_value_get_bytes(_key("op", seq), FOLLOWER_POLL_MS)
        except Exception as e:  # noqa: BLE001 - a timeout while rank 0 is idle, or the coordinator is gone
            if "DEADLINE_EXCEEDED" not in str(e):
                raise RankLostError(f"rank 0 (the coordinator) stopped ({short_cause(e)})") from None
            continue
        op, args = pickle.loads(data)
        seq += 1
        if op == "shutdown":
            return seq - 1
        if op == "run_batch":
            out = runner.run_batch(*args)
            logits = out[0] if isinstance(out, tuple) else out
        elif op == "sample":
            runner.sample(logits, *args)
        elif op == "write_pages":
            pages, k_template, v_template = args
            runner.write_pages(pages, *receive_shared(k_template, v_template))
        elif op in ("read_pages", "copy_pages"):
            getattr(runner, op)(*args)
        else:
            raise ValueError(f"unknown step message {op!r} (rank 0 runs another jaxserve version?)")
