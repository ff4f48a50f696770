"""A stop signal inside `sigterm_as_interrupt` is the interrupt, even where a library swallows it and fails later
with an error of its own (Optuna's trial commit over SQLite), and nothing else is."""
from __future__ import annotations

import signal
import sqlite3

import pytest

from selfspec.signals import sigterm_as_interrupt

optuna = pytest.importorskip("optuna")


def locked_study(tmp_path, swallowed_signal: int | None):
    """A real study over SQLite whose objective takes `swallowed_signal` inside a handler that swallows it (as
    SQLAlchemy's cursor cleanup can), then leaves the database write-locked by another connection, so that Optuna's
    commit of the finished trial fails with its own error chain: StorageInternalError, then "Should not reach"."""
    db = tmp_path / "study.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}", engine_kwargs={"connect_args": {"timeout": 0.05}})
    study = optuna.create_study(storage=storage, study_name="s")
    locker = sqlite3.connect(db, timeout=0.05, isolation_level=None)

    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        if swallowed_signal is not None:
            try:
                signal.raise_signal(swallowed_signal)
            except KeyboardInterrupt:
                pass
        locker.execute("BEGIN IMMEDIATE")  # readers go on, the trial's commit cannot
        return x

    return study, objective, locker


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_error_after_a_swallowed_stop_signal_is_the_interrupt(tmp_path, signum):
    study, objective, locker = locked_study(tmp_path, signum)
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signum)}") as caught:
        with sigterm_as_interrupt():
            study.optimize(objective, n_trials=1)
    locker.close()
    cause = caught.value.__cause__
    assert isinstance(cause, AssertionError)  # Optuna's own failure, kept as the cause
    assert isinstance(cause.__context__, optuna.exceptions.StorageInternalError)


def test_the_same_error_without_a_signal_is_left_as_it_is(tmp_path):
    study, objective, locker = locked_study(tmp_path, None)
    with pytest.raises(AssertionError, match="Should not reach"):
        with sigterm_as_interrupt():
            study.optimize(objective, n_trials=1)
    locker.close()


def test_the_block_restores_the_handlers_it_replaced():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            signal.raise_signal(signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in before} == before
