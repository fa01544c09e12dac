"""The reconciler: the single place where workflow state advances.

- consumes `<p>:events` (group `reconciler`) in batches and applies each event
  with `stage_event.lua` (idempotent, so two reconcilers, or a replay after a
  crash, never double-transition), which acks and deletes the event in the same
  atomic step: an event whose call was refused (OOM, READONLY...) or lost stays
  pending and is applied again (this reconciler re-reads its pending entries
  first); an event that does not decode, or that its script fails on, goes to
  `<p>:dlq:events` with the reason;
- reclaims events left pending by a dead reconciler (XAUTOCLAIM), and deletes
  the consumers that dead reconcilers left in the group;
- under a leased leader, sweeps periodically: workers whose lease lapsed
  (their sessions, i.e. their pending task entries, are re-queued with
  attempt + 1), scheduled retries that are due, workflow deadlines, and the
  listing index.

The package: `context` (what its parts share), `events` (consumption), `sweeps` (the periodic
passes) and `reconciler` (the `Reconciler` that runs them).
"""
from __future__ import annotations

from omniflow.engine.reconciler.events import PENDING, backoff_ms
from omniflow.engine.reconciler.reconciler import Reconciler, run_reconciler

__all__ = ["PENDING", "Reconciler", "backoff_ms", "run_reconciler"]
