"""The worker runtime: one process serving one stage (`omniflow worker --stage NAME`),
or several stages that share a device (`--stage thinker,talker`: DESIGN §1, a stage
is not a GPU). Each stage served keeps its own executor, session slots and task
stream; the process shares one intake read, one inbox, one group-commit
connection and one heartbeat between them.

- intake: one XREADGROUP on `<p>:stage:<name>@<version>:tasks` of every stage (of every pipeline version) served
  (group `workers`, consumer = worker id), only as many tasks as free session
  slots (backpressure; a stage with no free slot is left out of the read);
- claim: `claim.lua` per task, group-committed; drops tasks of retired workflows;
- inputs: the claim returns what the edge logs already hold; later chunks are
  forwarded by their producers to this worker's inbox stream, one XREAD for all sessions;
- compute: each stage's executor runs on its own compute thread (`omniflow.engine.compute`,
  unless it says `runs_on = "loop"`), so blocking model code never delays this loop; an
  executor with the default `runs_on = "auto"` has its sessions moved to this loop once
  their steps prove short, and back at a long one (`omniflow.engine.placement`);
- outputs: `emit.lua` / `finish.lua` through the group-commit `Batcher`;
- liveness: a heartbeat renews the worker's lease in `<p>:workers`; the
  reconciler re-queues the sessions of a worker whose lease lapsed (they are
  the worker's pending entries in the consumer group), and fencing by attempt
  keeps a worker that comes back from writing for them;
- abort: pub/sub on `<p>:abort` cancels a workflow's sessions at once (the
  tombstone and the fenced scripts are the durable truth);
- drain: `omniflow drain` sets `drain` on the worker's info hash; the heartbeat reads it
  and intake stops claiming until it is cleared, while the sessions held run to their end
  (graceful rolling restarts). The heartbeat also publishes the last minute of work
  (`omniflow.engine.window`) for `omniflow stats` and the dashboard.

The worker never decides workflow state: it reports to the reconciler.

The package, one part per module, each built around the shared `context.WorkerContext`:
`pool` (a stage served), `intake` (reads, hand-back, orphans), `claims` (claim.lua, sessions
built), `sessions` (running and closing them), `liveness` (heartbeat, drain, watchdog,
readiness), `inbox`, `abort` (fan-out, data-plane sweep), `chunks` (entry decoding), and
`worker` (the `Worker` that wires them and runs their loops).
"""
from __future__ import annotations

from omniflow.engine.worker.chunks import chunk_fields, decode_chunks, fields_dict, usage_json
from omniflow.engine.worker.pool import StagePool, parse_stages
from omniflow.engine.worker.worker import Worker, run_worker
from omniflow.storage.redisio import ensure_group

__all__ = ["StagePool", "Worker", "chunk_fields", "decode_chunks", "ensure_group", "fields_dict", "parse_stages",
           "run_worker", "usage_json"]
