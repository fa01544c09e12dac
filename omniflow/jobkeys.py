"""Key names of the job runner (webhooks, batches, the arq queue).

These extend `omniflow.keys.Keys`; they live here until they are folded into
`keys.py` (then `JobKeys` becomes an alias of `Keys`). Batch keys carry the
hash tag ``{<batch_id>}`` like workflow keys do.
"""
from __future__ import annotations

from dataclasses import dataclass

from omniflow.keys import Keys

NOTIFY_GROUP = "webhooks"


@dataclass(frozen=True, slots=True)
class JobKeys(Keys):
    @property
    def jobs_queue(self) -> str:
        """arq queue (zset) served by `omniflow jobs`."""
        return f"{self.prefix}:jobs"

    def job_id(self, kind: str, *parts: str) -> str:
        """arq job id; arq stores it under its own global `arq:job:<id>` keys, so it carries the prefix."""
        return ":".join((self.prefix, kind, *parts))

    def webhook(self, wf_id: str) -> str:
        """hash: delivery record of one workflow's webhook (state, outcome, attempts, last status/error)."""
        return f"{self.prefix}:webhook:{{{wf_id}}}"

    @property
    def webhook_secret(self) -> str:
        """string: the generated signing secret when `OMNIFLOW_WEBHOOK_SECRET` is unset."""
        return f"{self.prefix}:webhook-secret"

    def batch(self, batch_id: str) -> str:
        """hash: total, submitted, completed, failed, invalid, state, created_ms, finished_ms, ..."""
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch_input(self, batch_id: str) -> str:
        """hash: line number -> the validated request (JSON)."""
        return f"{self.batch(batch_id)}:input"

    def batch_lines(self, batch_id: str) -> str:
        """hash: line number -> {wf, state, error} (JSON)."""
        return f"{self.batch(batch_id)}:lines"

    def batch_done(self, batch_id: str) -> str:
        """stream: one entry when the batch ends (what `batch submit --wait` blocks on)."""
        return f"{self.batch(batch_id)}:done"

    @property
    def batches(self) -> str:
        """zset of batch ids scored by creation time (ms)."""
        return f"{self.prefix}:batches"
