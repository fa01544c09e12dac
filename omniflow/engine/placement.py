"""Where the sessions of an executor with `runs_on = "auto"` (the default) run: its compute thread,
or the worker's own loop once its steps have shown they are short.

A session on a compute thread pays cross-thread wake-ups: its start, each batch of inputs handed
in, its emits handed back, its result. On this project's 2-core machines that is ~130 µs a wake-up
and ~6 on the critical path of the toy pipeline (bench/notes.md, rounds 10-15): about 1.2-1.7 ms
of low-load latency and a third more worker CPU per workflow than `runs_on = "loop"`. An executor
whose steps (what `run` does between two awaits) take microseconds gains nothing from the thread:
it never holds the loop long enough to delay a heartbeat, a claim or an abort.

So an `auto` executor starts on its thread, and every session's steps are timed
(`time.perf_counter` around each `send` into its coroutine; ~0.3 µs a step). Over each window of
`WINDOW` sessions:

- on the thread, a window whose sessions' longest steps were all under `SLOW_STEP_S` and, for all
  but `WINDOW // 8` of them, under `SHORT_STEP_S` moves the executor to the loop. After the k-th
  move back, it takes `BACKOFF ** k` such windows in a row (capped: `MAX_BACKOFF_WINDOWS`);
- on the loop, a window with more than an eighth of its sessions not short, or more than a
  sixteenth slow, moves it back to the thread (a single step stretched by the machine's preemption
  does not), and so does at once any step longer than `LONG_STEP_S` (a blocking call: sleep, I/O,
  a forward pass).

The worst an executor that turns slow after its move can do is hold the loop for one step, once per
move, and each move needs four times as many short windows as the one before. Sessions already
running finish where they started: a move takes effect when none of the pool's sessions runs in the
old place, and a new session waits up to `MOVE_WAIT_S` for that (after a wait that ran out, none
waits for `MOVE_PATIENCE_S`: sessions of one pool that feed each other never deadlock on a move). So
the executor's code never runs on two threads at once, as with `thread` or `loop` (one exception: a
session cancelled on the thread, a timeout or an abort, leaves its place when the worker's loop sees
the cancellation, not once the thread has unwound it, so a move at that moment may let its last
step overlap the first session in the new place). `setup` and
`close` always run on the thread (a model load blocks), and a `BatchedExecutor` stays there (its
step loop is its own scheduler).

`runs_on = "thread"` pins an executor to its thread, `"loop"` to the loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any, TypeVar, get_args

from omniflow.executor.base import RunsOn

if TYPE_CHECKING:
    from omniflow.engine.compute import ComputeThread

logger = logging.getLogger(__name__)

T = TypeVar("T")

RUNS_ON: tuple[str, ...] = get_args(RunsOn)

WINDOW = 64                 # sessions judged together
SHORT_STEP_S = 0.001        # a step this short could run on the loop
SLOW_STEP_S = 0.005         # a window with a step longer than this stays on (or goes back to) the thread
LONG_STEP_S = 0.020         # one step this long on the loop sends the executor back at once
BACKOFF = 4                 # each move back multiplies the short windows the next move needs
MAX_BACKOFF_WINDOWS = 1024  # ... up to this many (65,536 sessions)
MOVE_WAIT_S = 0.05          # how long a new session waits for the old place to empty at a move
MOVE_PATIENCE_S = 1.0       # after a wait that ran out, how long none waits again


class Placement:
    """The place of one pool's sessions (see the module's docstring). Everything in it runs on the
    worker's loop: a session on the thread is judged once its result is back."""

    def __init__(self, stage: str, runs_on: RunsOn) -> None:
        if runs_on not in RUNS_ON:
            raise ValueError(f"stage {stage!r}: runs_on must be one of {', '.join(RUNS_ON)}, not {runs_on!r}")
        self.stage = stage
        self.auto = runs_on == "auto"
        self.on_loop = runs_on == "loop"      # where sessions start now
        self.want_loop = self.on_loop         # where the windows say they should
        self.running = 0                      # sessions running (all in one place: `on_loop`)
        self.moves = 0                        # times it moved (either way)
        self.backs = 0                        # times it went back to the thread
        self._passed = 0                      # short windows in a row on the thread
        self._sessions = self._short = self._slow = 0      # the current window
        self._idle: asyncio.Event | None = None
        self._patient_after = 0.0

    @property
    def needs_thread(self) -> bool:
        """The executor runs on a compute thread at all (setup and close always do): not `loop`."""
        return self.auto or not self.on_loop

    def pin_thread(self) -> None:
        """Never move (a `BatchedExecutor`)."""
        self.auto = False
        self.on_loop = self.want_loop = False

    # ------------------------------------------------------------ sessions
    async def run(self, coro: Coroutine[Any, Any, T], compute: ComputeThread | None) -> T:
        """Run one session's coroutine where the pool's sessions run now (`compute`: the pool's
        thread; None for an executor with `runs_on = "loop"`)."""
        if compute is None:
            return await coro
        if self.want_loop != self.on_loop:
            await self._move()
        self.running += 1
        on_loop = self.on_loop
        steps = _Steps(coro, self, on_loop) if self.auto else None
        try:
            if on_loop:
                return await steps if steps is not None else await coro     # (no coroutine around it)
            return await compute.run(steps.run() if steps is not None else coro)
        finally:
            self._leave(steps, on_loop)

    async def _move(self) -> None:
        """A session starts while a move is decided: the move takes effect if no session runs in
        the old place, after waiting up to `MOVE_WAIT_S` for that (none waits again for
        `MOVE_PATIENCE_S` after a wait that ran out)."""
        if self.running and time.monotonic() >= self._patient_after:
            self._idle = self._idle or asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), MOVE_WAIT_S)
            except TimeoutError:
                self._patient_after = time.monotonic() + MOVE_PATIENCE_S
        if not self.running and self.want_loop != self.on_loop:
            self._moved()

    def _leave(self, steps: _Steps | None, on_loop: bool) -> None:
        self.running -= 1
        if not self.running and self._idle is not None:
            self._idle.set()
            self._idle = None
        if steps is not None:
            self._ended(steps.longest, on_loop)

    def _moved(self) -> None:
        self.on_loop = self.want_loop
        self.moves += 1
        if self.on_loop:
            logger.info("stage %s: its executor's steps are short (%d sessions in a row): its sessions run on "
                        "the worker's loop now, without compute-thread hops", self.stage, self._need() * WINDOW)
        else:
            logger.warning("stage %s: its executor took long steps on the worker's loop: its sessions run on "
                           "its compute thread again (move back %d; the next move takes %d sessions)",
                           self.stage, self.backs, self._need() * WINDOW)

    def _need(self) -> int:
        return min(int(BACKOFF ** self.backs), MAX_BACKOFF_WINDOWS)

    # ------------------------------------------------------------ judging
    def _ended(self, longest: float, on_loop: bool) -> None:
        """A session's coroutine ended; `longest` is its longest step (seconds)."""
        if on_loop != self.want_loop:        # ran in the place the executor is leaving: judged already
            return
        self._sessions += 1
        self._short += longest <= SHORT_STEP_S
        self._slow += longest > SLOW_STEP_S
        if self._sessions < WINDOW:
            return
        # on the thread every session must have been quick (none slow, 7 in 8 short); on the loop,
        # where a busy machine's preemption lands inside a step now and then, only a pattern moves
        # it back: more than 1 in 8 not short, or more than 1 in 16 slow
        if on_loop:
            passed = self._slow <= WINDOW // 16 and self._short >= WINDOW - WINDOW // 8
        else:
            passed = not self._slow and self._short >= WINDOW - WINDOW // 8
        self._sessions = self._short = self._slow = 0
        if on_loop:
            if not passed:
                self._back()
        elif passed:
            self._passed += 1
            if self._passed >= self._need():
                self._passed = 0
                self.want_loop = True
        else:
            self._passed = 0

    def _long_step(self) -> None:
        """A step on the loop took longer than `LONG_STEP_S`."""
        if self.want_loop:
            self._back()

    def _back(self) -> None:
        self.want_loop = False
        self.backs += 1
        self._passed = 0
        self._sessions = self._short = self._slow = 0


class _Steps:
    """Drives a session's coroutine as `await` would, keeping its longest step. On the loop, a step
    longer than `LONG_STEP_S` tells the placement at once (on the loop's own thread); how the whole
    session went is judged when it ends, on the loop (`Placement._leave`)."""

    __slots__ = ("coro", "longest", "on_loop", "placement")

    def __init__(self, coro: Coroutine[Any, Any, Any], placement: Placement, on_loop: bool) -> None:
        self.coro, self.placement, self.on_loop = coro, placement, on_loop
        self.longest = 0.0

    async def run(self) -> Any:
        return await self

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, clock = self.coro, time.perf_counter
        value: Any = None
        error: BaseException | None = None
        while True:
            began = clock()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                self.longest = max(self.longest, clock() - began)
                return stop.value
            except BaseException:
                self.longest = max(self.longest, clock() - began)
                raise
            took = clock() - began
            if took > self.longest:
                self.longest = took
                if self.on_loop and took > LONG_STEP_S:
                    self.placement._long_step()
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:    # noqa: BLE001 - thrown in by the task (a cancellation): passed on
                value, error = None, exc
