"""Webhooks end to end: real engine, real arq jobs, a real HTTP receiver on 127.0.0.1."""
from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest
from arq.jobs import Job, JobResult, JobStatus
from standardwebhooks import Webhook

from omniflow.config import Settings
from omniflow.jobs.egress import EgressPolicy, EgressRefused, check_url, forbidden_reason
from omniflow.errors import InvalidRequest
from omniflow.storage.keys import NOTIFY_GROUP, Keys
from omniflow.storage.schema import s
from omniflow.jobs.queue import job_deserializer
from omniflow.jobs.runner import JobsRunner
from omniflow.jobs.webhooks import backoff_s, webhook_id

from conftest import toy_spec
from helpers import eventually, request
from jobs_support import FAST, SECRET, Receiver, http_receiver, jobs_runner


async def delivery(eng, wf_id: str) -> dict[str, str]:
    raw = await eng.redis.hgetall(Keys(eng.settings.prefix).webhook(wf_id))
    return {s(k): s(v) for k, v in raw.items()}


async def stats(eng) -> dict[str, int]:
    raw = await eng.redis.hgetall(Keys(eng.settings.prefix).stats)
    return {s(k): int(v) for k, v in raw.items() if s(k).startswith("webhook:")}


async def settled(eng, wf_id: str, outcome: str) -> dict[str, str]:
    async def check() -> dict[str, str] | None:
        rec = await delivery(eng, wf_id)
        return rec if rec.get("outcome") == outcome else None
    return await eventually(check, timeout_s=15)


async def finished_job(runner: JobsRunner, job_id: str) -> Any:
    """The result of arq job `job_id` once arq has finished it (it will not run again)."""
    assert runner.worker is not None
    job = Job(job_id, runner.worker.pool, _queue_name=runner.worker.queue_name, _deserializer=job_deserializer)

    async def result() -> JobResult | None:
        return await job.result_info() if await job.status() is JobStatus.complete else None
    return (await eventually(result, timeout_s=15, what=f"arq job {job_id} finished")).result


async def idle_longer_than(eng, consumer: str, idle_ms: int) -> bool:
    """Every notify entry `consumer` holds has been idle for more than `idle_ms` (XAUTOCLAIM may take it)."""
    keys = eng.store.keys
    held = await eng.redis.xpending_range(keys.notify(0), NOTIFY_GROUP, min="-", max="+", count=100, consumername=consumer)
    return bool(held) and all(e["time_since_delivered"] > idle_ms for e in held)


def verified(rec: Receiver, index: int = 0) -> dict:
    hit = rec.hits[index]
    return Webhook(SECRET).verify(hit.body, hit.headers)


# ---------------------------------------------------------------- pure rules
def test_backoff_schedule_grows_by_four_and_is_capped() -> None:
    assert [backoff_s(a, base_s=5, max_s=3600) for a in range(1, 8)] == [5, 20, 80, 320, 1280, 3600, 3600]


@pytest.mark.parametrize(("addr", "reason"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.7", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("100.64.0.1", "shared (CGNAT)"),
    ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("93.184.215.14", None), ("2606:4700::1", None),
])
def test_forbidden_addresses(addr: str, reason: str | None) -> None:
    assert forbidden_reason(ipaddress.ip_address(addr)) == reason


async def test_egress_policy_refuses_private_targets_unless_allow_listed() -> None:
    strict = EgressPolicy()
    for url, why in [("http://127.0.0.1:9/h", "loopback"), ("http://localhost/h", "loopback"),
                     ("http://[::ffff:10.0.0.1]/h", "private"), ("http://169.254.169.254/latest", "link-local"),
                     ("ftp://example.com/h", "scheme"), ("http://u:p@example.com/h", "credentials")]:
        with pytest.raises(EgressRefused, match=why):
            await check_url(url, strict)
    listed = EgressPolicy.from_settings(Settings(webhook_allow_hosts="127.0.0.1, 10.0.0.0/8"))
    assert str(await check_url("http://127.0.0.1:9/h", listed)) == "127.0.0.1"
    assert str(await check_url("http://10.9.9.9/h", listed)) == "10.9.9.9"
    with pytest.raises(EgressRefused, match="link-local"):
        await check_url("http://169.254.169.254/", listed)
    everything = EgressPolicy.from_settings(Settings(webhook_allow_private=True))
    assert str(await check_url("http://169.254.169.254/", everything)) == "169.254.169.254"


# ---------------------------------------------------------------- end to end
async def test_webhook_posts_the_signed_workflow_document(engine_factory) -> None:
    with http_receiver() as rec:
        async with engine_factory(**FAST) as eng, jobs_runner(eng):
            sub = await eng.store.submit(request("hello hooks", ["text"], webhook_url=rec.url()))
            doc = await eng.store.wait(sub.id, timeout_s=10)
            got = await settled(eng, sub.id, "delivered")
            assert len(rec.hits) == 1
            payload = verified(rec)
            assert payload == json.loads(json.dumps(doc)) and payload["state"] == "completed"
            headers = rec.hits[0].headers
            assert headers["webhook-id"] == webhook_id(sub.id, "completed") == got["webhook_id"]
            assert headers["webhook-signature"].startswith("v1,")
            assert headers["content-type"] == "application/json"
            assert got["attempts"] == "1" and got["status"] == "200"
            assert await stats(eng) == {"webhook:delivered": 1}
            assert await eng.redis.xlen(eng.store.keys.notify(0)) == 0     # acked and deleted


async def test_webhook_retries_with_backoff_and_the_same_id(engine_factory) -> None:
    with http_receiver([500, 500]) as rec:
        async with engine_factory(**FAST) as eng, jobs_runner(eng):
            sub = await eng.store.submit(request("retry me", ["text"], webhook_url=rec.url()))
            got = await settled(eng, sub.id, "delivered")
            assert len(rec.hits) == 3
            assert {h.headers["webhook-id"] for h in rec.hits} == {webhook_id(sub.id, "completed")}
            assert all(verified(rec, i)["id"] == sub.id for i in range(3))
            assert got["attempts"] == "3"
            assert await stats(eng) == {"webhook:retried": 2, "webhook:delivered": 1}
            hook = (await eng.store.document(sub.id))["webhook"]     # every attempt, in the document
            assert [(a["attempt"], a["outcome"], a["status"]) for a in hook["attempts"]] == [
                (1, "retried", 500), (2, "retried", 500), (3, "delivered", 200)]
            assert hook["outcome"] == "delivered" and hook["next_attempt_at"] is None


async def test_webhook_gives_up_after_max_attempts(engine_factory) -> None:
    with http_receiver([503] * 10) as rec:
        async with engine_factory(**{**FAST, "webhook_max_attempts": 2}) as eng, jobs_runner(eng):
            sub = await eng.store.submit(request("never heard", ["text"], webhook_url=rec.url()))
            got = await settled(eng, sub.id, "failed")
            assert len(rec.hits) == 2 and got["error"] == "HTTP 503" and got["attempts"] == "2"
            assert await stats(eng) == {"webhook:retried": 1, "webhook:failed": 1}


async def test_webhook_to_a_private_address_is_refused_at_submit(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False, **{**FAST, "webhook_allow_hosts": ""}) as eng:
        for url in ("http://127.0.0.1:9/hook", "http://127.1/hook", "http://localhost/x", "http://[::1]/x",
                    "http://10.0.0.7/x", "http://169.254.169.254/x", "gopher://example.com/x"):
            with pytest.raises(InvalidRequest, match="webhook_url"):
                await eng.store.submit(request("ssrf", ["text"], webhook_url=url))
        assert await eng.redis.zcard(eng.store.keys.all_wf(0)) == 0


async def test_webhook_to_a_name_that_resolves_private_at_delivery_is_refused_and_recorded(engine_factory,
                                                                                           caplog) -> None:
    with http_receiver() as rec:
        async with engine_factory(workers=False, **{**FAST, "webhook_allow_hosts": ""}) as eng, \
                jobs_runner(eng) as runner:
            sub = await eng.store.submit(request("ssrf", ["text"], webhook_url="http://hooks.example.com/x"))
            # the name pointed somewhere public at submit and points inside by delivery time (rebinding)
            await eng.redis.hset(eng.store.keys.wf(sub.id), "webhook", rec.url())
            await eng.add_worker("thinker")
            got = await settled(eng, sub.id, "refused")
            assert "loopback" in got["error"] and "OMNIFLOW_WEBHOOK_ALLOW_HOSTS" in got["error"]
            assert any("refused" in r.getMessage() and sub.id in r.getMessage() for r in caplog.records)
            assert await stats(eng) == {"webhook:refused": 1}
            # arq has finished the delivery job for good (its result is stored, nothing is re-queued):
            # no later attempt can still POST after the check below
            assert await finished_job(runner, eng.store.keys.job_id("webhook", sub.id, "completed")) == "refused"
            assert rec.hits == []
            hook = (await eng.store.document(sub.id))["webhook"]
            assert hook["outcome"] == "refused" and [a["outcome"] for a in hook["attempts"]] == ["refused"]
            assert "loopback" in hook["attempts"][0]["error"]


async def test_failed_workflow_webhook_carries_the_failure(engine_factory) -> None:
    spec = toy_spec(thinker={"fail_at_step": 1, "fail_retryable": False})
    with http_receiver() as rec:
        async with engine_factory(spec, **FAST) as eng, jobs_runner(eng):
            sub = await eng.store.submit(request("doomed", ["text"], webhook_url=rec.url()))
            await settled(eng, sub.id, "delivered")
            payload = verified(rec)
            assert payload["state"] == "failed" and "injected failure" in payload["error"]
            assert rec.hits[0].headers["webhook-id"] == webhook_id(sub.id, "failed")


async def test_notify_entries_of_a_dead_dispatcher_are_reclaimed(engine_factory) -> None:
    with http_receiver() as rec:
        async with engine_factory(**{**FAST, "event_claim_idle_ms": 100}) as eng:
            keys = eng.store.keys
            sub = await eng.store.submit(request("orphan", ["text"], webhook_url=rec.url()))
            await eng.store.wait(sub.id, timeout_s=10)
            await eng.redis.xgroup_create(keys.notify(0), NOTIFY_GROUP, id="0", mkstream=True)
            taken = await eng.redis.xreadgroup(NOTIFY_GROUP, "crashed", {keys.notify(0): ">"}, count=10)
            assert len(taken[0][1]) == 1                  # read by a dispatcher that then died
            await eventually(lambda: idle_longer_than(eng, "crashed", eng.settings.event_claim_idle_ms),
                             what="the dead dispatcher's entry idle past event_claim_idle_ms")
            async with jobs_runner(eng):
                await settled(eng, sub.id, "delivered")
            assert len(rec.hits) == 1
            assert await eng.redis.xpending(keys.notify(0), NOTIFY_GROUP) == {
                "pending": 0, "min": None, "max": None, "consumers": []}
