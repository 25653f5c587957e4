"""The engine core on a thread of its own, the one thread that touches it.

Callers never reach into the core. They hand the loop messages through one
inbox, and the loop takes them in the order they came, between steps:

    caller threads                         the loop thread
    --------------                         ---------------
    submit(requests)  --+                  +-- a Request: core.add, or core.finish if refused
    call(fn) -> value --+--> inbox ------> +-- a call: fn() (cancel, stats, weights, sleep...)
                                           +-- then core.step(), while it has work

So the core needs no lock (vLLM's engine core answers its client's
requests and utility calls the same way). A call waits for its answer: a
cancel takes effect between steps and the request's blocks are free when it
returns. Once the loop has ended (after `stop`), calls run in the caller's
thread, as nothing else touches the core then.

A pause (vLLM's pause_generation, around a weight update) is a state of the
loop, in one of three modes: "abort" ends the live requests with what they
have; "wait" lets them finish and steps nothing else; "keep" steps nothing,
so they stay as they are until `resume`. Requests submitted while paused are
held outside the core until then.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

from cbrun.engine.core import EngineCore, StepOutcome, TokenEvent
from cbrun.engine.request import Request, RequestStatus

PAUSE_MODES = ("abort", "wait", "keep")

log = logging.getLogger("cbrun.engine")

T = TypeVar("T")


class _Call(Generic[T]):
    """A function to run on the loop thread, and where its answer goes."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.future: Future[T] = Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # handed to the caller, who raises it
            self.future.set_exception(exc)


class CoreLoop:
    """Steps `core` on a background thread; `finished(request)` and `token(event)` receive what it produces
    (on that thread, or on the caller's once the loop has ended)."""

    def __init__(
        self, core: EngineCore, finished: Callable[[Request], None], token: Callable[[TokenEvent], None]
    ) -> None:
        self.core = core
        self._finished = finished
        self._token = token
        self._cond = threading.Condition()  # guards the inbox and the flags below; reentrant
        self._inbox: deque[Request | _Call] = deque()
        self._arrivals = itertools.count()
        self.draining = False  # no new requests; the loop ends once the core has no work
        self.closed = False  # destroyed: nothing more may run
        self._ended = False  # the loop thread has returned
        self.pause_mode: str | None = None  # paused in one of PAUSE_MODES, or running
        self._held: list[Request] = []  # submitted while paused: they reach the core at `resume`
        self._drained = threading.Event()  # paused and nothing left to step (what a "wait" pause waits for)
        self._thread = threading.Thread(target=self._run, name="cbrun-engine", daemon=True)

    def start(self) -> None:
        """Start the loop thread (the backend first prepares the process for it, from the caller's thread)."""
        self.core.backend.before_loop_thread()  # e.g. the loop thread's OpenMP pool must be the only one
        self._thread.start()

    # -- what callers hand over -------------------------------------------------
    def submit(self, admit: Callable[[], Sequence[Request]]) -> None:
        """Queue the requests `admit()` returns; `admit` runs with the inbox held, so its checks and
        bookkeeping happen in submission order. Raises RuntimeError once the engine is stopped."""
        with self._cond:
            if self.closed or self.draining:
                raise RuntimeError("engine is stopped; no new requests are accepted")
            for request in admit():
                request.arrival_order = next(self._arrivals)
                self._inbox.append(request)
            self._cond.notify()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the loop thread between steps, after everything handed over before it; its value or error."""
        with self._cond:
            call = self._enqueue(fn)
        return fn() if call is None else call.future.result()

    def _enqueue(self, fn: Callable[[], T]) -> _Call[T] | None:
        """Queue fn for the loop (inbox held); None when it must run in the caller's thread instead (the loop
        has ended, or this is the loop thread)."""
        if self._ended or threading.current_thread() is self._thread:
            return None
        call = _Call(fn)
        self._inbox.append(call)
        self._cond.notify()
        return call

    def call_idle(self, action: str, fn: Callable[[], T]) -> T:
        """fn() while nothing steps (else RuntimeError): no request queued, running or offloaded, or the loop
        paused (in "wait" mode, once its requests have finished). Submissions wait until it returns, so none
        slips in while it works."""

        def guarded() -> T:
            with self._cond:
                if self.closed:
                    raise RuntimeError(f"cannot {action}: the engine is destroyed")
                if self.pause_mode is None and (
                    self.core.has_work() or any(isinstance(message, Request) for message in self._inbox)
                ):
                    raise RuntimeError(
                        f"cannot {action} while requests are queued or running; wait for them or pause first"
                    )
                if self.pause_mode == "wait" and self.core.has_work():
                    raise RuntimeError(f"cannot {action} while paused requests are still finishing")
                return fn()

        return self.call(guarded)

    def end_live(
        self, select: Callable[[Request], bool], status: RequestStatus, reason: str, error: str | None = None
    ) -> list[Request]:
        """End every live request `select` picks (cancel, abort, hard stop, a failed step), those held by a
        pause included: the one way the engine ends requests from outside a step. Loop thread only (through
        `call`); returns the requests it ended."""
        held = [request for request in self._held if select(request)]
        ended = [request for request in self.core.live_requests() if select(request)]
        for request in held:
            self._held.remove(request)
            self.core.finish(request, status, reason, error)  # never reached the core: nothing to give back
            self._finished(request)
        for request in ended:
            try:
                self.core.remove(request, status, reason, error)
            except Exception:  # bookkeeping may be what broke; `remove` finishes the request first: deliver it
                log.exception("could not give back the blocks of request %s", request.request_id)
            self._finished(request)
        return held + ended

    # -- pause (loop thread, through `call`) ------------------------------------------
    def pause(self, mode: str) -> list[Request]:
        """Stop stepping new work: "abort" ends the live requests now (returned), "wait" steps only those in
        the core until they finish, "keep" steps nothing. Requests submitted from now on are held."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self.pause_mode is not None:
            raise RuntimeError(f"already paused (mode {self.pause_mode!r}); resume first")
        self.pause_mode = mode
        self._drained.clear()
        ended = self.end_live(lambda _: True, RequestStatus.CANCELLED, "abort") if mode == "abort" else []
        self._note_drained()
        return ended

    def resume(self) -> None:
        """Step again: kept requests go on, held ones reach the core in their submission order."""
        self.pause_mode = None
        for request in self._held:
            self.core.add(request)
        self._held.clear()

    def wait_drained(self) -> None:
        """Block until a pause has nothing left to step (its "wait" requests finished), or the loop has died."""
        while not self._drained.wait(0.1):
            if not self._thread.is_alive():
                raise RuntimeError("the engine's loop thread has stopped")

    def _note_drained(self) -> None:
        if self.pause_mode is not None and not self._stepping():
            self._drained.set()

    def _stepping(self) -> bool:
        """Whether the loop steps the core now: it has work and no pause forbids it."""
        return self.core.has_work() and self.pause_mode in (None, "wait")

    def stop(self, hard: bool, message: str, timeout: float | None) -> None:
        """No new requests; drain what is queued and running, or with `hard` end it now as failed."""

        def fail_all() -> bool:
            return bool(self.end_live(lambda _: True, RequestStatus.FAILED, "error", message))

        call: _Call[bool] | _Call[None] | None = None
        with self._cond:  # with the flag, so that no step runs between the two
            self.draining = True
            self._cond.notify()
            if hard:
                call = self._enqueue(fail_all)
            elif self.pause_mode is not None:
                call = self._enqueue(self.resume)  # a drain finishes what a pause kept or held
        if call is not None:
            call.future.result()
        elif hard:
            fail_all()
        elif self.pause_mode is not None:
            self.resume()
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # -- the loop thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    count = len(self._inbox)
                    if not count and not self._stepping():
                        if self.closed or self.draining:
                            return
                        self._cond.wait(timeout=0.5)
                        continue
                for _ in range(count):  # what arrived before this step; later messages wait for the next
                    with self._cond:
                        message = self._inbox.popleft()
                    self._handle(message)
                if self._stepping():
                    self._step_safely()
                self._note_drained()
        finally:
            with self._cond:
                self._ended = True
                left = [message for message in self._inbox if isinstance(message, _Call)]
            for call in left:  # only if the loop died: its callers must not wait forever
                call.future.set_exception(RuntimeError("the engine's loop thread has stopped"))

    def _handle(self, message: Request | _Call) -> None:
        if isinstance(message, _Call):
            message.run()
        elif message.error is not None:  # refused by the processor: it ends before it starts
            self.core.finish(message, RequestStatus.FAILED, "error", message.error)
            self._finished(message)
        elif self.pause_mode is not None:
            self._held.append(message)
        else:
            self.core.add(message)

    def _step_safely(self) -> None:
        """One step; an unexpected error fails the live requests instead of killing the loop."""
        try:
            self._publish(self.core.step())
        except Exception as exc:
            log.exception("engine step failed")
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            self.end_live(lambda _: True, RequestStatus.FAILED, "error", message)

    def _publish(self, outcome: StepOutcome) -> None:
        for event in outcome.tokens:
            self._token(event)
        for request in outcome.finished:
            self._finished(request)
