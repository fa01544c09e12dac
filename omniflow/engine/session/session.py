"""The `Session` dataclass: a session's fields with their defaults, over its parts."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omniflow.engine.session.consumers import Consumers, InputQueue, LocalInputs
from omniflow.engine.session.inputs import SessionInputs
from omniflow.executor import Session as ExecutorSession
from omniflow.models import Priority, SessionState

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from omniflow.engine.worker.slots import Slots
    from omniflow.dataplane.backpressure import EdgeWindow, WaitStats
    from omniflow.dataplane.base import Ref
    from omniflow.dataplane.plane import DataPlane
    from omniflow.storage.batcher import Batcher
    from omniflow.storage.keys import Keys


@dataclass
class Session(SessionInputs):
    """The engine's session: implements the executor contract's `Session` Protocol
    (`omniflow.executor.base`) with Redis behind it; everything else here is the worker's."""

    wf_id: str
    stage: str
    attempt: int
    input: dict[str, Any]
    params: dict[str, Any]
    finals: tuple[str, ...]
    downstream: tuple[str, ...]
    resume_seq: int
    _batcher: Batcher
    _keys: Keys
    upstream: tuple[str, ...] = ()
    required: tuple[str, ...] = ()        # every stage this workflow runs
    _queue: InputQueue = field(default_factory=InputQueue)
    _catchup: list[tuple[str, dict[bytes, bytes]]] = field(default_factory=list)
    _catchup_pos: int = 0
    _taken: deque[tuple[str, dict[bytes, bytes]]] = field(default_factory=deque)
    _input_timeout_s: float = 120.0
    seq: int = 0
    state: SessionState = SessionState.RUNNING      # WAITING_INPUT when it has upstream stages
    _inflight: set[asyncio.Future[Any]] = field(default_factory=set)
    waiting_since: float = 0.0          # monotonic time this session started waiting for input (0: not waiting)
    input_timed_out: bool = False
    input_wait_s: float = 0.0           # time spent waiting for upstream chunks (written on the worker's loop)
    backpressure_wait_s: float = 0.0    # time spent waiting for a consumer's room (written where emit runs)
    compute_s: float = 0.0              # the executor's time on it, less those waits (set by the worker)
    reported_usage: Mapping[str, Any] | None = None     # what the executor's `run` returned (set by the worker)
    _steps: list[list[Any]] = field(default_factory=list)
    _status: str = ""
    _finish: tuple[list[str], bytes] | None = None
    _done: bool = False                 # its finish closes it as done (set by `close`)
    _emit_keys: list[str] | None = None
    _consumers: Consumers = field(default_factory=Consumers)   # the worker's: which inboxes its emits declare
    _consumers_seen: int = -1
    # the worker's input queues, when a downstream stage may run on it: the chunks of a written call go
    # to its own consuming sessions in memory (no inbox copy), see `LocalInputs`
    _local: LocalInputs | None = None
    _open: asyncio.Future[Any] | None = None      # the queued write that is not built yet (takes more steps)
    _last_in: dict[str, int] = field(default_factory=dict)
    _write_error: BaseException | None = None
    checkpoint: str = ""                # what earlier attempts checkpointed (resume), see emit(checkpoint=)
    _home: asyncio.AbstractEventLoop | None = None   # the worker's loop (None: always called from it)
    _waiter: asyncio.Task[Any] | None = None         # the task waiting for input (the watchdog interrupts it)
    # data plane (None: every payload inline, no backpressure)
    _plane: DataPlane | None = None
    _domain_of: Callable[[str, str], Coroutine[Any, Any, str]] | None = None   # (wf, dst) -> its replica's shm domain
    _chunk_dsts: frozenset[str] = frozenset()        # downstream stages fed by `chunk` edges (bounded)
    _bp: WaitStats | None = None
    held: list[Ref] = field(default_factory=list)   # payload references read: released when done
    queue: str = ""     # the task queue it was claimed from (`Pipeline.queue`; '': the stage's name)
    _domains: dict[str, tuple[str, float]] = field(default_factory=dict)   # dst -> (domain, looked up at)
    _windows: dict[str, EdgeWindow] = field(default_factory=dict)
    _unreported: dict[str, tuple[int, int]] = field(default_factory=dict)  # src -> chunks, bytes read unreported
    trace: tuple[str, str] = ("", "")   # the workflow's W3C (traceparent, tracestate), from its record
    _span: Span | None = None           # this session's span while tracing is on (omniflow.tracing)
    # scheduling: the workflow's priority class and tenant, the task stream it came from ('': the
    # class's), and the stage's slots when it gives way at its chunks (None: never)
    priority: Priority = Priority.API
    tenant: str = ""
    tasks_key: str = ""
    _slots: Slots | None = None
    # the keys its finish declares to complete the workflow itself, its inflight set and result ttl
    # (None: a stage whose finish never completes it; see `SessionOutputs.close`)
    _completion: tuple[tuple[str, ...], str, int] | None = None
    # its workflow is of the storage layout before (claimed as one: `ClaimResult.LAYOUT`): its emits
    # declare `<wf>:stages`
    _legacy: bool = False
    completed: bool = False             # its finish completed the workflow (set by `close`)
    resynced_at: float = 0.0            # monotonic time its edge logs were last read again (worker's watchdog)


# mypy checks here that this class is what the executor contract promises (and
# tests/test_executor_contract.py checks it at run time, member by member).
_CONTRACT: type[ExecutorSession] = Session
