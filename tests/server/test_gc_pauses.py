"""Garbage collection and the server's pauses (D-44): start-up objects frozen out of collection,
SGLang's /freeze_gc, --gc-threshold and --gc-warning-threshold-secs."""

from __future__ import annotations

import gc
import logging
import re

import pytest

from jaxserve.server.gc_pauses import freeze_gc, warn_on_long_gc
from jaxserve.server_args import ServerArgs


@pytest.fixture
def restored_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_freeze_moves_live_objects_out_of_collection_and_sets_thresholds(restored_gc):
    kept = [[i] for i in range(1000)]  # tracked containers alive now
    assert gc.get_freeze_count() == 0
    frozen = freeze_gc("test", (900, 11, 12))
    assert frozen == gc.get_freeze_count() >= len(kept)
    assert gc.get_threshold() == (900, 11, 12)
    assert not any(obj is kept for obj in gc.get_objects(2))  # a full collection no longer walks them


@pytest.mark.parametrize("threshold_s, logged", [(0.0, True), (60.0, False)])
def test_a_collection_longer_than_the_threshold_is_logged(restored_gc, caplog, threshold_s, logged):
    callback = warn_on_long_gc(threshold_s)
    try:
        with caplog.at_level(logging.WARNING, logger="jaxserve.server.gc_pauses"):
            gc.collect()
    finally:
        gc.callbacks.remove(callback)
    found = re.search(r"long garbage collection: generation 2 took [0-9.]+ s \(objects per generation \[", caplog.text)
    assert bool(found) == logged, caplog.text


@pytest.mark.parametrize("values", [["1", "2", "3", "4"], ["-1"]])
def test_bad_gc_threshold_is_an_argparse_error(values, capsys):
    with pytest.raises(SystemExit) as exit_:
        ServerArgs.from_cli(["--gc-threshold", *values])
    assert exit_.value.code == 2
    assert "--gc-threshold takes 1 to 3 integers >= 0" in capsys.readouterr().err


def test_sglangs_gc_flags_parse():
    args = ServerArgs.from_cli(["--gc-threshold", "700", "10", "--gc-warning-threshold-secs", "0.5"])
    assert (args.gc_threshold, args.gc_warning_threshold_secs) == ((700, 10), 0.5)


def test_the_server_froze_its_start_up_objects(server):
    """Before: nothing was frozen, and a full collection of the start-up heap (about 815k objects) took
    0.4 s with the GIL held, long enough to delay /health past a router's timeout on a loaded machine."""
    froze = re.findall(r"server start-up: froze (\d+) objects", server.log())
    assert froze and int(froze[0]) > 100_000, server.log()[-3000:]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_freeze_gc_endpoint(http, server, method):
    response = http.request(method, "/freeze_gc")
    assert response.status_code == 200, response.text
    assert response.text == "Garbage collection frozen.\n"
    assert re.search(r"/freeze_gc: froze \d+ objects out of garbage collection \(\d+ frozen in all\)", server.log())
