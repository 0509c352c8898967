"""Ctrl-C inside ``interrupts_deferred`` waits for the block to end."""

from __future__ import annotations

import os
import signal
import time

import pytest

from heron.interrupts import interrupts_deferred


def test_a_sigint_inside_the_block_is_raised_after_it():
    finished = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here: it must not raise
            finished = True
    assert finished
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again


def test_a_block_without_a_sigint_raises_nothing():
    with interrupts_deferred():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
