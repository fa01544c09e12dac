"""The one exception tree of omniflow.

    OmniflowError
    ├── ConfigError            settings or environment are unusable (names the setting)
    │   └── RedisNotFound      no Redis configured and no `omniflow up` running (CLI exit 3)
    ├── PipelineError          a pipeline YAML is invalid (names the field and the reason)
    ├── RedisError             Redis did not do what was asked (translated from redis-py)
    │   ├── RedisUnavailable   transient: the connection was lost, refused or timed out
    │   │   └── RedisRefused   transient: the server answered with a refusal (OOM, READONLY, BUSY, LOADING...)
    │   └── ScriptError        not transient: a script or command failed on its own terms (bug or bad data)
    ├── MalformedEntry         a stream entry that does not decode or is out of bounds (poison: dead-lettered)
    ├── WorkflowError          a request about one workflow was refused
    │   ├── InvalidRequest     bad input: unknown modality, bad params, prompt too long (HTTP 422)
    │   ├── WorkflowNotFound   no such workflow, or not visible to this tenant (HTTP 404)
    │   ├── UnknownPipeline    a request names a pipeline (model) or version this deployment does not serve (HTTP 404)
    │   ├── WorkflowRetired    the id was aborted/failed before: use a fresh id (HTTP 409)
    │   ├── IdempotencyConflict a request_id reused with a different request (HTTP 409)
    │   ├── AdmissionRefused   over `max_in_flight`; carries retry_after_s (HTTP 429)
    │   │   └── FairShareRefused  the tenant is over its fair share while the deployment is busy (429)
    │   ├── PriorityNotAllowed a priority class above the tenant's allowance (HTTP 403)
    │   ├── DeadlineUnmeetable the queues predict a miss of the deadline; the pipeline refuses (HTTP 503)
    │   ├── NotReady           the thing asked for is not produced yet (HTTP 409)
    │   └── InputClosed        streamed input for a workflow that ended it, or has ended (HTTP 409)
    └── StageError             raised by executors
        ├── NonRetryableError  bad input for the stage: fail the workflow at once
        ├── Fenced             this session's attempt was superseded or the workflow ended
        └── DataPlaneError     a chunk's payload cannot be delivered (tree in `omniflow.dataplane.base`)

redis-py errors are translated at one boundary (`omniflow.storage.redisio`) with
`raise ... from exc`; every loop has one rule per class: retry `RedisUnavailable`
with backoff, dead-letter `MalformedEntry` (and the entry behind a `ScriptError`),
never exit, never acknowledge what was not applied.
"""
from __future__ import annotations


class OmniflowError(Exception):
    """Base of every error omniflow raises on purpose."""


class ConfigError(OmniflowError):
    """Settings or environment are unusable."""


class PipelineError(OmniflowError):
    """A pipeline spec is invalid; the message names the field and the reason."""


class RedisNotFound(ConfigError):
    """No Redis is configured (`OMNIFLOW_REDIS_URL`) and no `omniflow up` wrote its URL."""


class RedisError(OmniflowError):
    """Redis did not do what was asked (translated from redis-py in `omniflow.storage.redisio`)."""


class RedisUnavailable(RedisError):
    """Transient: the Redis server cannot be reached (connection lost, refused or timed out)."""


class RedisRefused(RedisUnavailable):
    """Transient: the server answered but refused the command (OOM, READONLY, BUSY, LOADING, ...).

    Nothing of the refused command was applied, so it is always safe to send it again."""

    def __init__(self, message: str, *, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal          # the server's error code: 'OOM', 'READONLY', 'BUSY', ...


class ScriptError(RedisError):
    """Not transient: a script or command failed on its own terms (a bug, or data it cannot take)."""


class MalformedEntry(OmniflowError):
    """A stream entry that does not decode or is out of bounds: poison, dead-lettered with the reason."""


class WorkflowError(OmniflowError):
    """A request about one workflow was refused."""

    code = "workflow_error"


class InvalidRequest(WorkflowError):
    """Bad input (HTTP 422)."""

    code = "invalid_request"


class WorkflowNotFound(WorkflowError):
    """No such workflow, or not visible to this tenant (HTTP 404)."""

    code = "not_found"


class UnknownPipeline(WorkflowError):
    """A request names a pipeline (an OpenAI `model`) or a version the deployment does not serve (HTTP 404)."""

    code = "model_not_found"

    def __init__(self, message: str, *, known: list[str] | None = None, param: str = "model") -> None:
        super().__init__(message)
        self.known = list(known or [])
        self.param = param          # the request field that named it (HTTP error body)


class WorkflowRetired(WorkflowError):
    """The id belongs to a retired (aborted or failed) workflow (HTTP 409)."""

    code = "retired"


class IdempotencyConflict(WorkflowError):
    """A request_id was reused with a different request body (HTTP 409)."""

    code = "idempotency_conflict"


class AdmissionRefused(WorkflowError):
    """Too many workflows in flight (HTTP 429)."""

    code = "over_capacity"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FairShareRefused(AdmissionRefused):
    """The tenant holds its fair share of `max_in_flight` and the deployment is busy (HTTP 429)."""

    code = "over_fair_share"


class PriorityNotAllowed(WorkflowError):
    """The request names a priority class above its tenant's allowance (HTTP 403)."""

    code = "priority_not_allowed"


class DeadlineUnmeetable(WorkflowError):
    """The stage queues predict the request would miss its deadline and its pipeline sheds by
    refusing (HTTP 503 with Retry-After)."""

    code = "deadline_unmeetable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(WorkflowError):
    """What was asked for is not produced yet (HTTP 409)."""

    code = "not_ready"


class InputClosed(WorkflowError):
    """Input appended to a workflow whose input has ended, or that has ended itself (HTTP 409)."""

    code = "input_closed"


class StageError(OmniflowError):
    """Raised by executors; retryable unless a subclass says otherwise."""

    retryable = True


class NonRetryableError(StageError):
    """The stage cannot succeed with this input: fail the workflow at once."""

    retryable = False


class Fenced(StageError):
    """The session lost ownership (newer attempt, or the workflow ended)."""

    retryable = False
