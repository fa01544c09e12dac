"""Every Redis key name omniflow uses, built in this one module.

All keys of one workflow carry the hash tag ``{<id>}`` so a Redis Cluster keeps
them in one slot. The Lua scripts derive a workflow's sub-keys from its base key
(``<prefix>:wf:{<id>}``) with the same suffixes as below.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "of"
TASK_GROUP = "workers"
EVENT_GROUP = "reconciler"
NOTIFY_GROUP = "webhooks"


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    # --- one workflow ---------------------------------------------------
    def wf(self, wf_id: str) -> str:
        return f"{self.prefix}:wf:{{{wf_id}}}"

    def stages(self, wf_id: str) -> str:
        return f"{self.wf(wf_id)}:stages"

    def log(self, wf_id: str) -> str:
        return f"{self.wf(wf_id)}:log"

    def done(self, wf_id: str) -> str:
        """One entry (`state`), written with the terminal log entry: what `wait` blocks on."""
        return f"{self.wf(wf_id)}:done"

    def edge(self, wf_id: str, src: str, dst: str) -> str:
        return f"{self.wf(wf_id)}:edge:{src}:{dst}"

    def out(self, wf_id: str, stage: str) -> str:
        return f"{self.wf(wf_id)}:out:{stage}"

    def blob(self, wf_id: str, src: str, dst: str, attempt: int, seq: int) -> str:
        """A chunk payload too large for its edge entry (the entry holds a reference to it)."""
        return f"{self.wf(wf_id)}:blob:{src}:{dst}:{attempt}:{seq}"

    def blobs(self, wf_id: str) -> str:
        """Set of a workflow's payload keys (`blob`): what its terminal releases."""
        return f"{self.wf(wf_id)}:blobs"

    def tomb(self, wf_id: str) -> str:
        return f"{self.prefix}:tomb:{wf_id}"

    def idem(self, tenant: str, key: str) -> str:
        """Idempotency key of (tenant, request id). The tenant is length-prefixed: both parts may
        contain ':', and (`team`, `a:x`) must never meet (`team:a`, `x`)."""
        return f"{self.prefix}:idem:{len(tenant)}:{tenant}:{key}"

    # --- global ---------------------------------------------------------
    def tasks(self, stage: str) -> str:
        return f"{self.prefix}:stage:{stage}:tasks"

    def dlq(self, stage: str) -> str:
        return f"{self.prefix}:dlq:{stage}"

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def inflight(self) -> str:
        return f"{self.prefix}:inflight"

    @property
    def all_wf(self) -> str:
        """zset of every workflow id scored by creation time (listing, GC)."""
        return f"{self.prefix}:all"

    def state_index(self, state: str) -> str:
        """zset of the workflow ids in one state, scored by creation ms (kept by the Lua transitions)."""
        return f"{self.prefix}:idx:state:{state}"

    def tenant_index(self, tenant: str) -> str:
        """zset of one tenant's workflow ids, scored by creation ms (written by submit.lua)."""
        return f"{self.prefix}:idx:tenant:{tenant}"

    @property
    def tenants(self) -> str:
        """set of the tenant names that have a tenant index (so the sweep can trim them)."""
        return f"{self.prefix}:idx:tenants"

    @property
    def retries(self) -> str:
        """zset of scheduled retries, member ``<id>|<stage>|<attempt>``, score due ms."""
        return f"{self.prefix}:retries"

    @property
    def workers(self) -> str:
        """zset of live workers scored by lease expiry (ms)."""
        return f"{self.prefix}:workers"

    def worker_info(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def inbox(self, worker_id: str) -> str:
        """A worker's input stream: chunks for its sessions, forwarded by the producers' emits."""
        return f"{self.prefix}:inbox:{worker_id}"

    def wake(self, owner_id: str) -> str:
        """Private stream a process blocks on beside its data streams, to be woken."""
        return f"{self.prefix}:wake:{owner_id}"

    @property
    def abort_channel(self) -> str:
        return f"{self.prefix}:abort"

    @property
    def notify(self) -> str:
        """Stream of terminal workflows that asked for a webhook."""
        return f"{self.prefix}:notify"

    # --- job runner (webhooks, batches) ---------------------------------
    @property
    def jobs_queue(self) -> str:
        return f"{self.prefix}:jobs"

    def job_id(self, kind: str, *parts: str) -> str:
        return ":".join((self.prefix, kind, *parts))

    def webhook(self, wf_id: str) -> str:
        return f"{self.prefix}:webhook:{{{wf_id}}}"

    def webhook_attempts(self, wf_id: str) -> str:
        """list of one workflow's webhook delivery attempts (JSON, oldest first)."""
        return f"{self.webhook(wf_id)}:attempts"

    @property
    def webhook_secret(self) -> str:
        return f"{self.prefix}:webhook-secret"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch_input(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:input"

    def batch_lines(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:lines"

    def batch_done(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:done"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def stats(self) -> str:
        return f"{self.prefix}:stats"
