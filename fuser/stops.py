"""How a run is stopped: Ctrl-C and SIGTERM held back over a step that must not stop halfway, and
a -j worker ended by SIGTERM as an exception unwinds it, its cleanup run to the end."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

# The signals that stop a run (fuser.cli.stop_on_sigterm makes SIGTERM one).
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held():
    """Hold Ctrl-C and SIGTERM back until the block ends, where the signal is taken: a worker
    starting (one not yet listed among those to end would run on, writing its model after fuser
    has gone), a model and its data file renamed into place (a stop between them would pair
    the old model with the new weights).

    Held by Python's handlers, which run in the main thread, not by the thread's signal mask: the
    system hands a signal to any thread that does not block it (numpy's own threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; it is the one a signal stops anyway
        return
    taken: list[int] = []
    # Only what Python handles is held: a signal ignored stays so (a fork server started now
    # must inherit that), and one whose default ends the process would end it just the same.
    previous = {number: signal.getsignal(number) for number in STOPPING_SIGNALS}
    previous = {number: handler for number, handler in previous.items() if callable(handler)}
    for number in previous:
        signal.signal(number, lambda number, frame: taken.append(number))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if taken:
            signal.raise_signal(taken[0])  # to the handler it would have met


def end_on_sigterm() -> None:
    """Make SIGTERM end this process as an exception unwinds it (SystemExit, 128 + SIGTERM).

    A SIGTERM reaches a worker twice when it is sent to fuser's process group (from the group,
    then from fuser ending its workers): once one unwinds, the next is let go, so that the
    cleanup under way (temporaries removed, renames undone) runs to the end. Where one lands in
    a finalizer or a weakref callback, its exception cannot unwind: Python would print it as
    ignored (a traceback among a CI log's lines) and carry on. It is sent again instead, to land
    where it can, and not printed."""
    code = 128 + signal.SIGTERM
    unwinding: list[SystemExit] = []  # raised, and not known to have been swallowed
    passed_on = sys.unraisablehook

    def ended(number, frame) -> None:
        if unwinding:
            return
        error = SystemExit(code)
        unwinding.append(error)
        raise error

    def unraisable(event) -> None:
        if any(event.exc_value is error for error in unwinding):
            unwinding.clear()
            with contextlib.suppress(RuntimeError):  # no new thread at the interpreter's end, nor need of one
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
            return
        passed_on(event)

    sys.unraisablehook = unraisable
    signal.signal(signal.SIGTERM, ended)
