"""The one Ctrl-C / SIGTERM handler (``kiln_core.training.interrupt``), in this process.

What a user relies on: the first Ctrl-C (or a ``kill``) asks training to stop at the next step boundary
and says so once; a second Ctrl-C stops at once; whatever handlers were there before come back after the
run. The trainers' own ``handle_signals`` (``lifecycle.stop_signals``) behaves the same, being the same
handler. End to end through the CLI: ``test_train_cli.py`` (two Ctrl-Cs) and ``test_interrupt.py``.
"""

from __future__ import annotations

import signal
import threading

import pytest

from kiln_core.training.interrupt import stop_requests

MESSAGE = "stopping at the next step boundary after a checkpoint (Ctrl-C again to stop now)"


def previous_handlers():
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def test_the_first_ctrl_c_asks_for_a_stop_and_the_second_stops_now(capsys):
    before = previous_handlers()
    with stop_requests() as stop:
        assert not stop.is_set()
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            signal.raise_signal(signal.SIGINT)
    assert previous_handlers() == before
    assert capsys.readouterr().err.strip() == f"interrupted: {MESSAGE}"


def test_sigterm_asks_for_a_stop_and_never_stops_mid_step(capsys):
    """Prefect cancelling a flow run, or ``kill`` sent twice: always the cooperative stop."""
    with stop_requests() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set()
    assert capsys.readouterr().err.strip() == f"terminated: {MESSAGE}"  # said once


def test_sigterm_false_takes_over_ctrl_c_only():
    """In a run a Prefect worker started, SIGTERM stays the worker's (``tasks/train.py``): the handler
    installed before keeps getting it, while Ctrl-C still asks for a stop."""
    received = []

    def installed_before(signum, _frame):
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, installed_before)
    try:
        with stop_requests(sigterm=False) as stop:
            assert signal.getsignal(signal.SIGTERM) is installed_before
            signal.raise_signal(signal.SIGTERM)
            assert received == [signal.SIGTERM] and not stop.is_set()
            signal.raise_signal(signal.SIGINT)
            assert stop.is_set()
        assert signal.getsignal(signal.SIGTERM) is installed_before
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_disabled_or_off_the_main_thread_installs_nothing():
    before = previous_handlers()
    with stop_requests(enabled=False) as stop:
        assert previous_handlers() == before
        stop.request_stop("cancelled")  # the flag still works for a caller that sets it
        assert stop.is_set()

    seen = {}

    def in_a_thread():
        with stop_requests() as stop:
            seen["handlers"], seen["set"] = previous_handlers(), stop.is_set()

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == {"handlers": before, "set": False}


def test_the_trainers_handle_signals_is_the_same_handler(capsys):
    """``train_opd(handle_signals=True)`` (a ``torchrun`` rank, a direct caller): one Ctrl-C stops at the
    next boundary, a second stops now, exactly as under the engine."""
    from kiln_core.training.lifecycle import stop_signals

    before = previous_handlers()
    with stop_signals(True) as signalled:
        signal.raise_signal(signal.SIGINT)
        assert signalled.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert previous_handlers() == before
    with stop_signals(False) as signalled:
        assert previous_handlers() == before and not signalled.is_set()
    assert MESSAGE in capsys.readouterr().err
