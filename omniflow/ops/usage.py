"""Usage per tenant, read back for a window: `omniflow usage`, `GET /v1/usage`.

The counters are written by the sessions' finishes (`omniflow.storage.usage`: one hash per cell and
hour); `read_usage` sums the hours that overlap the window (its start rounded down to the hour, no
further back than the retention) over every cell, per tenant, pipeline and stage, with the filters
checked first: a tenant or pipeline that this deployment has never seen is an error naming the
known ones, never an empty answer that looks like "no usage".
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from omniflow.client.store import Store
from omniflow.errors import InvalidRequest
from omniflow.storage.keys import UNINDEXED_TENANT
from omniflow.storage.redisio import translated
from omniflow.storage.schema import now_ms, s
from omniflow.storage.usage import BUCKET_S, METRICS, bucket_of, bucket_start_s, parse_field

logger = logging.getLogger(__name__)

DEFAULT_SINCE_S = 86_400.0
PIPELINE_CHUNK = 1_000          # hashes read per round trip
MAX_NAMES_SHOWN = 20
#: the counters as served: ms become seconds
SERVED = {"sessions": "sessions", "compute_ms": "compute_s", "failed_compute_ms": "failed_compute_s",
          "audio_ms": "audio_s", "prompt_tokens": "prompt_tokens", "completion_tokens": "completion_tokens"}


def _served(totals: dict[str, int]) -> dict[str, float | int]:
    return {SERVED[m]: round(totals.get(m, 0) / 1000, 3) if m.endswith("_ms") else totals.get(m, 0) for m in METRICS}


def _names(names: Iterable[str]) -> str:
    shown = sorted(names)
    more = f", … ({len(shown) - MAX_NAMES_SHOWN} more)" if len(shown) > MAX_NAMES_SHOWN else ""
    return ", ".join(shown[:MAX_NAMES_SHOWN]) + more if shown else "none"


@translated
async def known_tenants(store: Store) -> set[str]:
    """Every tenant that has submitted a workflow still indexed (the cells' tenant sets), and
    `UNINDEXED_TENANT` (never in those sets) once it has submitted one (its field in a cell's live counts)."""
    pipe = store.client.pipeline(transaction=False)
    for cell in store.keys.all_cells:
        pipe.smembers(store.keys.tenants(cell))
        pipe.hget(store.keys.tenant_inflight(cell), UNINDEXED_TENANT)
    replies = await pipe.execute()
    names = {s(name) for members in replies[0::2] for name in members}
    return names | {UNINDEXED_TENANT} if any(x is not None for x in replies[1::2]) else names


def check_filter(kind: str, value: str | None, known: set[str]) -> None:
    """A filter naming nothing this deployment knows is bad input (it names the known values)."""
    if value is not None and value not in known:
        raise InvalidRequest(f"{kind}: no {kind} {value!r} here (known: {_names(known)})")


@translated
async def read_usage(store: Store, *, tenant: str | None = None, pipeline: str | None = None,
                     since_s: float = DEFAULT_SINCE_S, tenants: Iterable[str] = (),
                     pipelines: Iterable[str] = ()) -> dict[str, Any]:
    """Usage over the last `since_s` seconds, per tenant, pipeline and stage, and per tenant and
    pipeline (summed over stages), optionally for one `tenant` and/or `pipeline`. `tenants` and
    `pipelines`: names known besides what Redis holds (configured API keys, loaded pipelines)."""
    if not since_s > 0:
        raise InvalidRequest(f"since: {since_s!r} must be a positive number of seconds")
    retention_s = store.settings.usage_retention_days * 86_400
    now = now_ms()
    first = bucket_of(now - int(min(since_s, retention_s) * 1000))
    last = bucket_of(now)
    hashes = [(cell, bucket) for bucket in range(first, last + 1) for cell in store.keys.all_cells]
    counts: dict[tuple[str, str, str], dict[str, int]] = {}
    skipped = 0
    for i in range(0, len(hashes), PIPELINE_CHUNK):
        pipe = store.client.pipeline(transaction=False)
        for cell, bucket in hashes[i:i + PIPELINE_CHUNK]:
            pipe.hgetall(store.keys.usage(cell, bucket))
        for raw in await pipe.execute():
            for field, value in raw.items():
                parsed = parse_field(s(field))
                if parsed is None or not s(value).lstrip("-").isdigit():
                    skipped += 1
                    continue
                pipe_name, stage, metric, who = parsed
                row = counts.setdefault((who, pipe_name, stage), {})
                row[metric] = row.get(metric, 0) + int(s(value))
    if skipped:
        logger.warning("usage: %d field(s) that are not usage counters skipped", skipped)
    check_filter("tenant", tenant, {*tenants, *(await known_tenants(store)), *(k[0] for k in counts)})
    check_filter("pipeline", pipeline, {*pipelines, *store.catalog.names, *(k[1] for k in counts)})
    rows = [{"tenant": who, "pipeline": pipe_name, "stage": stage, **_served(metrics)}
            for (who, pipe_name, stage), metrics in sorted(counts.items())
            if (tenant is None or who == tenant) and (pipeline is None or pipe_name == pipeline)]
    by_tenant: dict[tuple[str, str], dict[str, int]] = {}
    for (who, pipe_name, _stage), metrics in counts.items():
        if (tenant is None or who == tenant) and (pipeline is None or pipe_name == pipeline):
            total = by_tenant.setdefault((who, pipe_name), {})
            for metric, value in metrics.items():
                total[metric] = total.get(metric, 0) + value
    return {
        "since": bucket_start_s(first), "until": now / 1000, "bucket_s": BUCKET_S,
        "retention_days": store.settings.usage_retention_days,
        "tenant": tenant, "pipeline": pipeline,
        "rows": rows,
        "tenants": [{"tenant": who, "pipeline": pipe_name, **_served(metrics)}
                    for (who, pipe_name), metrics in sorted(by_tenant.items())],
    }
