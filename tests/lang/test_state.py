"""The state machinery on a scripted backend: variables, errors, fork, join, streaming, run_batch."""

from __future__ import annotations

import threading
import time

import pytest

from jaxserve.lang import (
    BackendError,
    ProgramError,
    ProgramState,
    UnknownVariableError,
    function,
    gen,
    select,
    set_default_backend,
)
from tests.lang.fakes import FakeBackend


@function
def qa(s, question):
    s += "Q: " + question + "\nA:"
    s += gen("answer", max_tokens=4)


def test_text_and_variables():
    backend = FakeBackend(reply=lambda prompt, params: " " + prompt.split("Q: ")[1].split("\n")[0].upper())
    state = qa.run("hello", backend=backend)
    assert state.text() == "Q: hello\nA: HELLO"
    assert state["answer"] == " HELLO" and "answer" in state
    assert state.get_meta_info("answer")["params"] == {"max_new_tokens": 4}


def test_run_sampling_defaults_are_overridden_by_gen():
    backend = FakeBackend()
    qa.run("x", backend=backend, temperature=0, max_new_tokens=99, stop="\n")
    assert backend.calls[0][1][1] == {"temperature": 0, "max_new_tokens": 4, "stop": ["\n"]}


def test_unknown_variable_names_it_and_lists_known():
    state = qa.run("x", backend=FakeBackend())
    with pytest.raises(KeyError) as info:
        state["nope"]
    assert isinstance(info.value, UnknownVariableError)
    assert str(info.value) == "unknown variable 'nope'; the state's variables are: 'answer'"


def test_unknown_variable_inside_a_program_propagates():
    @function
    def reads_missing(s):
        s += "hi"
        s += s["missing"]

    with pytest.raises(UnknownVariableError, match="'missing'.*none yet"):
        reads_missing.run(backend=FakeBackend())


def test_backend_error_propagates_from_run():
    def fail(prompt, params):
        raise BackendError(400, "regex: invalid regex", param="regex")

    with pytest.raises(BackendError, match="invalid regex") as info:
        qa.run("x", backend=FakeBackend(reply=fail))
    assert info.value.status_code == 400 and info.value.param == "regex"


def test_no_backend_is_a_clear_error():
    set_default_backend(None)
    with pytest.raises(ProgramError, match="no backend"):
        qa.run("x")


def test_bad_arguments_raise_type_error():
    with pytest.raises(TypeError):
        qa.run(backend=FakeBackend())


def test_fork_branches_run_in_parallel_and_share_the_prefix():
    barrier = threading.Barrier(4, timeout=10)  # breaks unless the 4 branches generate at the same time

    def reply(prompt, params):
        barrier.wait()
        return prompt[-2]  # the branch number

    backend = FakeBackend(reply=reply)

    @function
    def tips(s):
        s += "Prefix."
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f" tip {i}:" + gen("tip")
        for i, f in enumerate(forks):
            s += f["tip"]
        s += str(forks[2].text())

    state = tips.run(backend=backend)
    assert state.text() == "Prefix.0123" + "Prefix. tip 2:2"
    assert backend.calls[0] == ("cache_prefix", "Prefix.")  # the shared prefix is committed once


def test_fork_join_gathers_variables():
    @function
    def fan(s):
        s += "x"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += str(i) + gen("v")
        forks.join()

    state = fan.run(backend=FakeBackend(reply=lambda p, q: p[-1] * 2))
    assert state["v"] == ["00", "11", "22"]


def test_error_in_unread_branch_fails_the_program():
    @function
    def fan(s):
        s += "x"
        f = s.fork(2)
        f[1] += gen("v")

    def fail(prompt, params):
        raise BackendError(500, "boom")

    with pytest.raises(BackendError, match="boom"):
        fan.run(backend=FakeBackend(reply=fail))


def test_select_uses_backend_scores(default_tokenizer):
    # every token of " yes" scores -1, every other token -3: "yes" wins although "no" is shorter
    yes_ids = set(default_tokenizer.encode("A: yes", add_special_tokens=False))
    backend = FakeBackend(default_tokenizer, token_logprob=lambda t: -1.0 if t in yes_ids else -3.0)

    @function
    def pick(s):
        s += "A:"
        s += " " + select("c", ["no", "yes"])

    state = pick.run(backend=backend)
    assert state["c"] == "yes" and state.text() == "A: yes"
    scores = state.get_meta_info("c")
    assert scores.normalized_logprobs[1] == -1.0
    assert sum(1 for kind, _ in backend.calls if kind == "prompt_logprobs") == 1  # one batched request


def test_stream_text_iter_yields_pieces_while_running():
    release = threading.Event()

    def reply(prompt, params):
        if params.get("max_new_tokens") == 2:
            release.wait(10)
        return "abc"

    @function
    def two(s):
        s += "start "
        s += gen("first", max_tokens=1)
        s += " then "
        s += gen("second", max_tokens=2)

    state = two.run(backend=FakeBackend(reply=reply), stream=True)
    assert "".join(state.text_iter("first")) == "abc"  # finishes before the program does
    pieces = state.text_iter()
    assert next(pieces) == "start "
    release.set()
    assert "start " + "".join(pieces) == state.text() == "start abc then abc"
    assert "".join(state.text_iter("second")) == "abc"


def test_stream_error_is_raised_by_text_iter():
    def fail(prompt, params):
        raise BackendError(503, "down")

    state = qa.run("x", backend=FakeBackend(reply=fail), stream=True)
    with pytest.raises(BackendError, match="down"):
        list(state.text_iter())


def test_run_batch_keeps_order_and_runs_in_parallel():
    active, peak, lock = [0], [0], threading.Lock()

    def reply(prompt, params):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return prompt.split("Q: ")[1].split("\n")[0]

    states = qa.run_batch([{"question": f"q{i}"} for i in range(16)], backend=FakeBackend(reply=reply), num_threads=8,
                          progress_bar=False)
    assert [s["answer"] for s in states] == [f"q{i}" for i in range(16)]
    assert peak[0] > 1
    assert [s["answer"] for s in qa.run_batch([["a"], ["b"]], backend=FakeBackend(reply=lambda p, q: p[3]))] == ["a", "b"]


def test_standalone_state_needs_no_program():
    state = ProgramState(FakeBackend(reply=lambda p, q: "!"))
    state += "hi" + gen("x")
    assert state.text() == "hi!" and state.variables() == {"x": "!"}
