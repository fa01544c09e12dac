"""Usage per tenant: counted once per finished stage session (retries and finishes sent again
included), read back per tenant, pipeline and stage over a window, through `omniflow usage`."""
from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from conftest import toy_spec
from helpers import cli_env, omniflow, request

from omniflow.client.store import Store, connect
from omniflow.errors import InvalidRequest
from omniflow.ops.usage import read_usage
from omniflow.pipeline import build_pipeline
from omniflow.storage import redisio
from omniflow.storage.keys import TASK_GROUP
from omniflow.storage.redisio import ensure_group
from omniflow.storage.schema import now_ms, s
from omniflow.storage.usage import BUCKET_S, Meter, bucket_of, parse_field
from omniflow.workers.toy import reply_words

SAMPLES_PER_CHUNK = int(22050 * 0.08)     # the toy vocoder's chunk


def _row(doc: dict, tenant: str, stage: str) -> dict:
    return next(r for r in doc["rows"] if r["tenant"] == tenant and r["stage"] == stage)


async def test_each_finished_session_counts_once_with_retries(engine_factory) -> None:
    # the thinker fails at its 2nd step once (retried: attempt 2 resumes), the talker fails once too
    spec = toy_spec(thinker={"token_delay_s": 0.01, "fail_at_step": 2, "fail_attempts": 1},
                    talker={"fail_at_step": 3, "fail_attempts": 1})
    async with engine_factory(spec) as eng:
        sub = await eng.store.submit(request("count me once please"), tenant="acme")
        doc = await eng.store.wait(sub.id, timeout_s=20)
        assert doc["state"] == "completed" and doc["stages"]["thinker"]["attempt"] == 2
        text = await eng.store.submit(request("just text", ["text"]), tenant="globex")
        assert (await eng.store.wait(text.id, timeout_s=20))["state"] == "completed"

        usage = await read_usage(eng.store, since_s=3600)
        assert {(r["tenant"], r["stage"]) for r in usage["rows"]} == {
            ("acme", "thinker"), ("acme", "talker"), ("acme", "code2wav"), ("globex", "thinker")}
        assert all(r["pipeline"] == eng.pipeline.name for r in usage["rows"])
        thinker = _row(usage, "acme", "thinker")
        assert thinker["sessions"] == 1 and thinker["completion_tokens"] == len(reply_words("count me once please", 8))
        assert thinker["prompt_tokens"] == 4 and thinker["failed_compute_s"] > 0 and thinker["compute_s"] > 0
        assert thinker["audio_s"] == 0
        code2wav = _row(usage, "acme", "code2wav")
        assert code2wav["sessions"] == 1 and code2wav["audio_s"] == round(8 * SAMPLES_PER_CHUNK / 22050, 3)
        assert code2wav["prompt_tokens"] == code2wav["completion_tokens"] == 0
        assert _row(usage, "acme", "talker")["sessions"] == 1
        assert _row(usage, "globex", "thinker")["completion_tokens"] == len(reply_words("just text", 8))
        acme = next(t for t in usage["tenants"] if t["tenant"] == "acme")
        assert acme["sessions"] == 3 and acme["audio_s"] == code2wav["audio_s"]
        assert acme["compute_s"] == pytest.approx(sum(r["compute_s"] for r in usage["rows"] if r["tenant"] == "acme"))
        # the stage hash keeps each stage's compute (RTF, tokens/s on /metrics)
        stages = await eng.redis.hgetall(eng.store.keys.stages(sub.id))
        assert int(stages[b"thinker:compute_ms"]) == round(thinker["compute_s"] * 1000)

        # each worker set the hour's expiry once, with its first finish there
        usage_keys = [k async for k in eng.redis.scan_iter(match=f"{eng.settings.prefix}:*:usage:*")]
        assert usage_keys and all(ttl > 80 * 86_400 for ttl in [await eng.redis.ttl(k) for k in usage_keys])

        only = await read_usage(eng.store, tenant="globex", pipeline=eng.pipeline.name, since_s=600)
        assert [(r["tenant"], r["stage"]) for r in only["rows"]] == [("globex", "thinker")]
        assert only["since"] == bucket_of(now_ms() - 600_000) * BUCKET_S
        with pytest.raises(InvalidRequest, match=r"no tenant 'initech' here \(known: acme, globex\)"):
            await read_usage(eng.store, tenant="initech")
        with pytest.raises(InvalidRequest, match="no pipeline 'omni-gpu'"):
            await read_usage(eng.store, pipeline="omni-gpu")
        with pytest.raises(InvalidRequest, match="since"):
            await read_usage(eng.store, since_s=0)


@pytest.fixture
async def store(valkey_url, settings_factory):
    redis = connect(valkey_url)
    st = Store(redis, settings_factory(valkey_url), build_pipeline(toy_spec()))
    await redisio.load_scripts(redis)
    for stage in st.pipeline.order:
        await ensure_group(redis, st.tasks_key(stage, 0), TASK_GROUP)
    yield st
    keys = [k async for k in redis.scan_iter(match=f"{st.settings.prefix}:*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


async def test_a_finish_sent_again_adds_nothing_and_a_malformed_meter_writes_nothing(store) -> None:
    sub = await store.submit(request("once", ["text"]), tenant="acme")
    reply = await store.client.xreadgroup(TASK_GROUP, "w1", {store.tasks_key("thinker", 0): ">"}, count=1)
    entry_id = s(reply[0][1][0][0])
    wf = store.keys.wf(sub.id)
    claimed = await redisio.script(store.client, "claim", [store.tasks_key("thinker", 0),
                                                        store.keys.state_index("running", 0), wf,
                                                        f"{wf}:log"],
                                 [store.settings.prefix, TASK_GROUP, "w1", now_ms(), "", "thinker", entry_id, sub.id, 1])
    assert s(claimed[0][0]) == "ok"
    bucket = bucket_of(now_ms())
    usage_key = store.keys.usage(0, bucket)
    meter = Meter.of(usage_key, bucket=bucket, retention_days=7, compute_s=0.25,
                     usage={"prompt_tokens": 1, "completion_tokens": 3.0, "ignored": "x"})
    keys = [wf, store.tasks_key("thinker", 0), store.keys.events(0), f"{wf}:log",
            f"{wf}:out:thinker", usage_key]

    async def finish(fin_meter: list) -> str:
        steps = msgpack.packb([[1, "T", "hi", ""]], use_bin_type=False)
        fin = msgpack.packb([TASK_GROUP, entry_id, "done", "{}", "1", 1, "", fin_meter], use_bin_type=False)
        return s(await redisio.script(store.client, "emit", keys,
                                    ["thinker", 1, "", now_ms(), sub.id, steps, fin]))

    with pytest.raises(Exception, match="the finish is malformed"):
        await finish([usage_key, "soon", 250, 1, 3])
    assert not await store.client.exists(usage_key)
    assert await finish(meter.fields()) == "ok"
    assert await finish(meter.fields()) == "fenced"          # sent again (its reply lost): counted once
    counts = {parse_field(s(k)): int(v) for k, v in (await store.client.hgetall(usage_key)).items()}
    name = store.pipeline.name
    assert counts == {(name, "thinker", "sessions", "acme"): 1, (name, "thinker", "compute_ms", "acme"): 250,
                      (name, "thinker", "prompt_tokens", "acme"): 1, (name, "thinker", "completion_tokens", "acme"): 3}
    ttl = await store.client.ttl(usage_key)
    assert (bucket + 1) * BUCKET_S + 7 * 86_400 - now_ms() // 1000 - ttl in (0, 1)


def test_usage_fields_carry_any_tenant_name() -> None:
    assert parse_field("omni|thinker|compute_ms|team|a:b") == ("omni", "thinker", "compute_ms", "team|a:b")
    assert parse_field("omni|thinker|bogus|t") is None and parse_field("no separators") is None
    meter = Meter.of("k", bucket=10, retention_days=1, compute_s=-1.0, usage={"prompt_tokens": True,
                                                                             "completion_tokens": float("nan")})
    assert (meter.compute_ms, meter.prompt_tokens, meter.completion_tokens) == (0, 0, 0)
    assert meter.expire_at_s == 11 * BUCKET_S + 86_400
    assert Meter.of("k", bucket=10, retention_days=1, compute_s=1.0, usage=None, set_expiry=False).expire_at_s == 0


async def test_usage_command(engine_factory, tmp_path: Path) -> None:
    async with engine_factory() as eng:
        env = cli_env(eng, tmp_path)
        sub = await eng.store.submit(request("through the cli"), tenant="acme")
        assert (await eng.store.wait(sub.id, timeout_s=20))["state"] == "completed"
        code, out, err = await omniflow("usage", "--json", "--since", "2h", env=env)
        assert code == 0, err
        doc = json.loads(out)
        assert {(r["tenant"], r["stage"]) for r in doc["rows"]} == {("acme", "thinker"), ("acme", "talker"),
                                                                    ("acme", "code2wav")}
        code, out, err = await omniflow("usage", "--tenant", "acme", "--pipeline", eng.pipeline.name, env=env)
        assert code == 0, err
        assert "acme" in out and "code2wav" in out and "all" in out
        code, _, err = await omniflow("usage", "--tenant", "nobody", env=env)
        assert code == 2 and "no tenant 'nobody'" in err
        code, _, err = await omniflow("usage", "--since", "yesterday", env=env)
        assert code == 2 and "'yesterday' is not a duration" in err
        code, _, err = await omniflow("usage", "--pipeline", "nope", env=env)
        assert code == 2 and "no pipeline 'nope'" in err
