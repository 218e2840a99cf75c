"""Stopping the grader: SIGTERM, SIGHUP and SIGINT become GraderStopped, so its clean-up runs and it still reports.

The handler raises in the main thread wherever it is. Where Python ignores exceptions (a weakref callback, a
__del__, run by the garbage collector at that moment) the exception is printed and dropped, and the grader would
go on waiting for the notebook. So the handler also records the signal, and the loops that wait
(Kernel.run's polling) call raise_if_stopped(), which raises it again within one poll.
"""

from __future__ import annotations

import signal

_received: list[str] = []  # the names of the stopping signals received since stop_on_signals()


class GraderStopped(Exception):
    """SIGTERM, SIGHUP or SIGINT reached the grader: it stops, kills everything, and still reports."""


def stop_on_signals() -> None:
    """Turn SIGTERM, SIGHUP and SIGINT into GraderStopped in the main thread (the clean-up then runs)."""
    def handler(number, frame):
        _received.append(signal.Signals(number).name)
        raise GraderStopped(_received[-1])

    _received.clear()
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(number, handler)


def raise_if_stopped() -> None:
    """Raise GraderStopped if a stopping signal came, even one whose exception was dropped where it landed."""
    if _received:
        raise GraderStopped(_received[0])
