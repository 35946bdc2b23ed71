"""kvattn in a fork()ed child (multiprocessing's "fork" start method): the
module's cached default context, made and used by the parent before the
fork (its pool workers running), works in the child and gives the parent's
result bit for bit; also when another parent thread is inside calls on that
context at the moment of the fork. A child that hangs fails the test after
a timeout instead of stalling the suite."""
import multiprocessing
import os
import threading

import numpy as np
import pytest

import kvattn

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork") or "fork" not in multiprocessing.get_all_start_methods(),
                       reason="no fork start method on this platform"),
    # Python 3.12+ warns about fork() in a multi-threaded process (the pool's workers): the point here.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

THREADS = 2  # a pool with a worker even on one core
TIMEOUT = 30.0


def _inputs():
    rng = np.random.default_rng(20261201)
    q = rng.standard_normal((2, 8, 2, 128), dtype=np.float32)
    k = rng.standard_normal((2, 2, 1500, 128), dtype=np.float32)
    v = rng.standard_normal((2, 2, 1500, 128), dtype=np.float32)
    return q, kvattn.quantize(k, group_size=64, bits=4), kvattn.quantize(v, group_size=64, bits=4)


def _attend(inputs):
    q, k, v = inputs
    return kvattn.attention(q, k, v, mask="causal", group_size=64, bits=4, threads=THREADS)


def _child(conn, inputs):
    try:
        conn.send(("ok", _attend(inputs).tobytes()))
    except BaseException as e:  # reported to the parent, which fails the test
        conn.send(("error", repr(e)))
    finally:
        conn.close()


def _run_child(inputs):
    """The child's result bytes (or raises AssertionError on a hang / error)."""
    mp = multiprocessing.get_context("fork")
    recv, send = mp.Pipe(duplex=False)
    p = mp.Process(target=_child, args=(send, inputs))
    p.start()
    send.close()
    answered = False
    try:
        answered = recv.poll(TIMEOUT)
        if not answered:
            raise AssertionError("the fork()ed child did not answer within %.0f s (hung)" % TIMEOUT)
        status, payload = recv.recv()
    finally:
        p.join(TIMEOUT if answered else 0)
        if p.is_alive():
            p.kill()
            p.join()
        recv.close()
    assert status == "ok", payload
    assert p.exitcode == 0
    return payload


def test_fork_child_uses_default_context():
    inputs = _inputs()
    expected = _attend(inputs).tobytes()  # starts the default context's pool in the parent
    assert kvattn.default_context(THREADS).threads == THREADS
    for _ in range(2):
        assert _run_child(inputs) == expected
    assert _attend(inputs).tobytes() == expected  # the parent's context still works


def test_fork_while_another_thread_calls():
    inputs = _inputs()
    expected = _attend(inputs).tobytes()
    stop = threading.Event()
    errors = []

    def busy():
        while not stop.is_set():
            try:
                if _attend(inputs).tobytes() != expected:
                    errors.append("a parent call differed")
            except BaseException as e:
                errors.append(repr(e))

    t = threading.Thread(target=busy)
    t.start()
    try:
        for _ in range(6):
            assert _run_child(inputs) == expected
    finally:
        stop.set()
        t.join()
    assert not errors, errors
