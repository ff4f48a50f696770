"""A SIGTERM taken as Ctrl-C, for the commands that keep what they finished when stopped (bench, prepare)."""
from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """`timeout` and job schedulers stop a run with SIGTERM: inside this block it raises KeyboardInterrupt, so that
    the command's own handling of Ctrl-C (write what is done, record the time spent) runs.

    A library can swallow the interrupt where it lands (a cursor's cleanup in SQLAlchemy, under an Optuna trial's
    commit) and fail later with an error of its own, with the interrupt nowhere in its chain. So the block records
    each stop signal it takes, and an error that leaves it after one is raised as the interrupt it follows from.
    A signal handler can only be set from the main thread; elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken: list[int] = []

    def interrupt(signum, frame):
        taken.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        yield
    except Exception as err:
        if taken:
            raise KeyboardInterrupt(f"signal {taken[0]}") from err
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
