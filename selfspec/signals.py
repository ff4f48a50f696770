"""A SIGTERM taken as Ctrl-C, for the commands that keep what they finished when stopped (bench, prepare)."""
from __future__ import annotations

import contextlib
import signal
import threading


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """`timeout` and job schedulers stop a run with SIGTERM: inside this block it raises KeyboardInterrupt, so that
    the command's own handling of Ctrl-C (write what is done, record the time spent) runs. A signal handler can only
    be set from the main thread; elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
