"""The Lua scripts on their own, against every Redis-protocol server on this machine
(Valkey always; redis-server too when it is on PATH)."""
from __future__ import annotations

import re
from typing import Any

import msgpack
import pytest

from omniflow.storage import redisio
from omniflow.storage.transitions import sessions
from omniflow.storage.transitions.emit import EMIT_OUT
from omniflow.storage.keys import TASK_GROUP
from omniflow.pipeline import build_pipeline
from omniflow.engine.reconciler import Reconciler
from omniflow.client.store import Store, connect
from omniflow.storage.schema import now_ms, s
from omniflow.engine.worker import ensure_group

from conftest import toy_spec
from helpers import request


@pytest.fixture
async def store(any_server_url, settings_factory):
    redis = connect(any_server_url)
    st = Store(redis, settings_factory(any_server_url), build_pipeline(toy_spec()))
    await redisio.load_scripts(redis)
    for stage in st.pipeline.order:
        await ensure_group(redis, st.tasks_key(stage, 0), TASK_GROUP)
    yield st
    await redis.aclose()


def claim_keys(store: Store, stage: str, wf_id: str, upstream: tuple[str, ...] = ()) -> list[str]:
    wf = store.keys.wf(wf_id)
    return [store.tasks_key(stage, 0), store.keys.state_index("running", 0),
            wf, f"{wf}:log", *(f"{wf}:edge:{u}:{stage}" for u in upstream)]


def emit_keys(store: Store, wf_id: str, stage: str, downstream: tuple[str, ...] = ()) -> list[str]:
    """What a session declares (Session.emit_keys): a script touching anything else fails."""
    wf = store.keys.wf(wf_id)
    return [wf, store.tasks_key(stage, 0), store.keys.events(0), f"{wf}:log", f"{wf}:out:{stage}",
            *(f"{wf}:edge:{stage}:{d}" for d in downstream)]


async def claim_next(store: Store, stage: str, worker: str = "w1") -> tuple[str, list]:
    reply = await store.client.xreadgroup(TASK_GROUP, worker, {store.tasks_key(stage, 0): ">"}, count=1)
    entry_id, fields = reply[0][1][0]
    res = await redisio.script(store.client, "claim", claim_keys(store, stage, s(fields[b"wf"])),
                             [store.settings.prefix, TASK_GROUP, worker, now_ms(), "", stage,
                              s(entry_id), s(fields[b"wf"]), s(fields[b"a"])])
    return s(entry_id), [s(x) for x in res[0][:6]]


async def bind_talker(store: Store, wf_id: str, worker: str = "w1") -> str:
    """Deliver workflow `wf_id`'s talker task to `worker` and claim it there (the talker bound to
    that replica, as a consuming worker's claim does); the task's entry id."""
    delivered = await store.client.xreadgroup(TASK_GROUP, worker, {store.tasks_key("talker", 0): ">"}, count=1)
    entry_id = s(delivered[0][1][0][0])
    await redisio.script(store.client, "claim", claim_keys(store, "talker", wf_id, ("thinker",)),
                         [store.settings.prefix, TASK_GROUP, worker, now_ms(), "thinker", "talker", entry_id, wf_id, "1"])
    return entry_id


async def emit(store: Store, wf_id: str, stage: str, attempt: int, seq: int, text: str) -> str:
    steps = msgpack.packb([[seq, "T", text, ""]], use_bin_type=False)      # a final text delta, as a session sends it
    res = await redisio.script(store.client, "emit", emit_keys(store, wf_id, stage),
                               [stage, attempt, "", now_ms(), wf_id, steps])
    return s(res)


async def test_a_script_refuses_a_key_it_was_not_given(store) -> None:
    """Every key a script touches must be declared (Redis Cluster routes and checks by KEYS)."""
    sub = await store.submit(request())
    await claim_next(store, "thinker")           # the thinker has written to its edge: the claim reads it
    steps = msgpack.packb([[1, "E", "talker", ["seq", 1, "a", 1, "d", "c1"]]], use_bin_type=False)
    assert s(await redisio.script(store.client, "emit", emit_keys(store, sub.id, "thinker", ("talker",)),
                                  ["thinker", 1, "", now_ms(), sub.id, steps])) == "ok"
    delivered = await store.client.xreadgroup(TASK_GROUP, "w1", {store.tasks_key("talker", 0): ">"}, count=1)
    talker_task = s(delivered[0][1][0][0])
    with pytest.raises(Exception, match="undeclared key .*:edge:thinker:talker"):
        await redisio.script(store.client, "claim", claim_keys(store, "talker", sub.id),      # its edge left out
                             [store.settings.prefix, TASK_GROUP, "w1", now_ms(), "thinker", "talker", talker_task,
                              sub.id, "1"])


async def test_a_call_sees_nothing_of_the_call_before(store) -> None:
    """The scripts are functions of one library whose helpers are built once (scripts.py): every
    table a call fills (the edge entries it gathers, the keys it declared) is made fresh by the next."""
    sub = await store.submit(request())
    await claim_next(store, "thinker")
    keys = emit_keys(store, sub.id, "thinker", ("talker",))
    edge = store.keys.edge(sub.id, "thinker", "talker")

    async def call(seq: int, *ops: Any, declared: list[str] = keys) -> str:
        steps = msgpack.packb([[seq, *ops]], use_bin_type=False)
        return s(await redisio.script(store.client, "emit", declared, ["thinker", 1, "", now_ms(), sub.id, steps]))

    assert await call(1, "E", "talker", ["seq", 1, "a", 1, "d", "c1"]) == "ok"
    assert await call(2, "A", EMIT_OUT, "x") == "ok"
    assert await store.client.xlen(edge) == 1, "the second call wrote the first one's edge entry again"
    with pytest.raises(Exception, match="undeclared key .*:edge:thinker:talker"):
        await call(3, "E", "talker", ["seq", 3, "a", 1, "d", "c3"], declared=emit_keys(store, sub.id, "thinker"))
    assert await store.client.xlen(edge) == 1


async def test_submit_creates_record_and_presubmits_chunk_stages(store) -> None:
    sub = await store.submit(request())
    for stage in ("thinker", "talker", "code2wav"):
        assert await store.client.xlen(store.tasks_key(stage, 0)) == 1
    assert await store.client.zscore(store.keys.inflight(0), sub.id) is not None
    assert s(await store.client.hget(store.keys.wf(sub.id), "state")) == "pending"


async def test_claim_drops_tasks_of_tombstoned_workflows(store) -> None:
    sub = await store.submit(request())
    await store.abort(sub.id)
    _, res = await claim_next(store, "thinker")
    assert res == ["drop", "aborted"]
    assert await store.client.xlen(store.tasks_key("thinker", 0)) == 0       # acked and deleted
    assert (await store.client.xpending(store.tasks_key("thinker", 0), TASK_GROUP))["pending"] == 0


async def test_final_text_goes_to_the_record_or_for_a_record_of_before_to_its_out_key(store) -> None:
    """Layout 3: a text final's deltas are appended to its `<stage>:text` field in the record (no
    key of its own: no APPEND, no EXPIRE, no second read for the document). A record of before (no
    `ko`) keeps its text in `<wf>:out:<stage>`, and the readers read it there."""
    new, old = (await store.submit(request(modalities=["text"]))).id, (await store.submit(request(modalities=["text"]))).id
    await store.client.hdel(store.keys.wf(old), "ko")
    for _ in range(2):
        assert (await claim_next(store, "thinker"))[1][0] == "ok"
    for wf_id in (new, old):
        assert await emit(store, wf_id, "thinker", 1, 1, "a") == "ok"
        assert await emit(store, wf_id, "thinker", 1, 2, "b") == "ok"
        assert await store.text(wf_id, "thinker") == "ab"
        assert (await store.document(wf_id))["outputs"]["thinker"]["text"] == "ab"
    assert s(await store.client.hget(store.keys.wf(new), "thinker:text")) == "ab"
    assert await store.client.exists(store.keys.out(new, "thinker")) == 0
    assert s(await store.client.get(store.keys.out(old, "thinker"))) == "ab"
    assert await store.client.hexists(store.keys.wf(old), "thinker:text") == 0


async def test_emit_is_idempotent_on_seq_and_fenced_by_attempt(store) -> None:
    sub = await store.submit(request(modalities=["text"]))
    _, res = await claim_next(store, "thinker")
    assert res[0] == "ok"
    assert await emit(store, sub.id, "thinker", 1, 1, "a") == "ok"
    assert await emit(store, sub.id, "thinker", 1, 1, "a") == "dup"
    assert await emit(store, sub.id, "thinker", 1, 2, "b") == "ok"
    # the session is re-queued (its worker was declared dead): attempt 2 owns the stage now
    rec = Reconciler(settings=store.settings, pipeline=store.pipeline, redis_url="unused")
    rec.redis = store.client
    assert await rec.sweeps.dead_workers() == 0       # no dead worker registered yet
    await store.client.zadd(store.keys.workers, {"w1": 1})
    assert await rec.sweeps.dead_workers() == 1
    assert await emit(store, sub.id, "thinker", 1, 3, "stale") == "fenced"
    assert await store.text(sub.id, "thinker") == "ab"
    _, res = await claim_next(store, "thinker", "w2")
    assert res[0] == "ok" and res[5] == "2"           # resumes after the 2 steps already written
    assert await emit(store, sub.id, "thinker", 2, 3, "c") == "ok"
    assert await store.text(sub.id, "thinker") == "abc"


@pytest.mark.parametrize("steps, payloads, message", [
    ([[1, "Z", "x", ""]], 0, "step 1: unknown op Z"),
    ([["one", "T", "x", ""]], 0, "step 1 has no seq"),
    ([[1, "T", "x", ""], [2, "P", "talker", ""]], 0, "step 2: op P needs a packed chunk"),
    ([[1, "T", "x", ""], [2, "X", 4, ["odd"]]], 0, "step 2: op X needs field pairs"),
    ([[1, "B", 7, ["blob", 10]]], 0, "payload keys missing from KEYS"),        # KEYS[6] is the blobs set
    ([[1, "B", 6, ["blob", 10]]], 1, "step 1: op B names no payload key"),     # KEYS[7] is the payload
    ([[1, "B", "k", ["blob", 10]]], 1, "step 1: op B names no payload key"),
    ([[1, "T", "x", ""], [2, "B", 7, ["blob", 0]]], 1, "step 2: op B needs {payload, ttl_ms}"),
])
async def test_an_emit_with_a_malformed_step_is_refused_with_what_is_wrong_and_writes_nothing(
        store, steps: list, payloads: int, message: str) -> None:
    """Every step is checked before anything is written (a script that fails part-way is not
    rolled back): the error names the step and what is wrong with it."""
    sub = await store.submit(request(modalities=["text"]))
    _, res = await claim_next(store, "thinker")
    assert res[0] == "ok"
    wf = store.keys.wf(sub.id)
    keys = [*emit_keys(store, sub.id, "thinker"), f"{wf}:blobs", *(f"{wf}:blob:{i}" for i in range(payloads))]
    with pytest.raises(Exception, match=re.escape(f"emit: {message} (nothing written)")):
        await redisio.script(store.client, "emit", keys,
                             ["thinker", 1, "", now_ms(), sub.id, msgpack.packb(steps, use_bin_type=False)])
    assert await store.text(sub.id, "thinker") == ""
    assert s(await store.client.hget(store.keys.wf(sub.id), "thinker:seq")) == "0"
    for k in keys[4:]:
        assert not await store.client.exists(k)
    assert await emit(store, sub.id, "thinker", 1, 1, "a") == "ok"            # the session goes on


async def test_one_emit_call_writes_one_text_entry_and_one_entry_per_edge(store) -> None:
    """Steps 1 (text + chunk), 2 (chunk only), 3 (text + chunk) of a thinker in one call, the talker
    bound to worker w1: one text log entry for steps 1..3, one edge entry and one inbox entry with
    the three chunks; replaying the call writes nothing."""
    sub = await store.submit(request())
    await claim_next(store, "thinker")
    await bind_talker(store, sub.id)
    chunk = lambda n: ["E", "talker", ["seq", n, "a", 1, "d", f"c{n}"]]  # noqa: E731
    steps = msgpack.packb([[1, "T", "a", "", *chunk(1)], [2, *chunk(2)], [3, "T", "b", "", *chunk(3)]],
                          use_bin_type=False)
    args = ["thinker", 1, "", now_ms(), sub.id, steps]
    keys = emit_keys(store, sub.id, "thinker", ("talker",))
    # the talker's inbox is not declared: nothing is written, and the reply names whose it is
    assert [s(x) for x in await redisio.script(store.client, "emit", keys, args)] == ["inbox", "talker", "w1"]
    assert await store.client.xlen(store.keys.edge(sub.id, "thinker", "talker")) == 0
    assert await store.text(sub.id, "thinker") == ""
    # a later call of the same attempt waits its turn until the refused one is sent again
    later = msgpack.packb([[4, "T", "c", ""]], use_bin_type=False)
    assert [s(x) for x in await redisio.script(store.client, "emit", keys,
                                               ["thinker", 1, "", now_ms(), sub.id, later])] == ["inbox", "", ""]
    keys = [*keys, store.keys.inbox("w1", 0)]
    assert s(await redisio.script(store.client, "emit", keys, args)) == "ok"
    texts = [f for _, f in await store.read_log(sub.id) if f.get("t") == "text"]
    assert texts == [{"t": "text", "stage": "thinker", "from": "1", "seq": "3", "delta": "ab"}]
    assert await store.text(sub.id, "thinker") == "ab"
    edge = await store.client.xrange(store.keys.edge(sub.id, "thinker", "talker"))
    inbox = await store.client.xrange(store.keys.inbox("w1", 0))
    assert len(edge) == 1 and len(inbox) == 1
    chunks = msgpack.unpackb(edge[0][1][b"m"], raw=True)
    assert [dict(zip(c[::2], c[1::2]))[b"seq"] for c in chunks] == [1, 2, 3]
    assert inbox[0][1][b"m"] == edge[0][1][b"m"] and inbox[0][1][b"ds"] == b"talker"
    assert s(await redisio.script(store.client, "emit", keys, args)) == "dup"
    assert await store.client.xlen(store.keys.edge(sub.id, "thinker", "talker")) == 1


async def test_a_consumer_bound_to_the_calling_worker_gets_no_inbox_copy_and_the_reply_names_it(store) -> None:
    """A worker names itself in its emit calls (ARGV[8]): a consumer bound to it needs no declared
    inbox and gets no inbox entry; the reply names it and its attempt, so the worker hands it the
    call's chunks in memory. The edge log has them, as always. Another replica's call is refused for
    that consumer's inbox as before."""
    sub = await store.submit(request())
    await claim_next(store, "thinker")
    await bind_talker(store, sub.id, worker="w1")
    keys = emit_keys(store, sub.id, "thinker", ("talker",))
    packed = msgpack.packb(["seq", 1, "a", 1, "d", "c1"], use_bin_type=False)
    steps = msgpack.packb([[1, "P", "talker", packed]], use_bin_type=False)
    refused = await redisio.script(store.client, "emit", keys, ["thinker", 1, "", now_ms(), sub.id, steps, "", "w2"])
    assert [s(x) for x in refused] == ["inbox", "talker", "w1"]
    reply = await redisio.script(store.client, "emit", keys, ["thinker", 1, "", now_ms(), sub.id, steps, "", "w1"])
    assert [s(x) for x in reply] == ["ok", "talker", "1"]
    (entry,) = await store.client.xrange(store.keys.edge(sub.id, "thinker", "talker"))
    assert msgpack.unpackb(entry[1][b"m"], raw=True) == [[b"seq", 1, b"a", 1, b"d", b"c1"]]
    assert await store.client.xlen(store.keys.inbox("w1", 0)) == 0
    # a call that writes no edge names no consumer
    text = msgpack.packb([[2, "A", EMIT_OUT, "x"]], use_bin_type=False)
    assert s(await redisio.script(store.client, "emit", keys, ["thinker", 1, "", now_ms(), sub.id, text, "", "w1"])) == "ok"


async def test_one_claim_of_a_workflows_stages_reads_and_writes_its_record_once_and_logs_one_entry(store) -> None:
    """What one read delivered for the three stages of a workflow is claimed with one call: each task
    answered in order, the record bound for all three, and ONE log entry holding the call's four
    events (the workflow running, then each stage), which the readers expand, each with its id."""
    sub = await store.submit(request())
    groups, upstream = [], {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",)}
    for stage in ("thinker", "talker", "code2wav"):
        delivered = await store.client.xreadgroup(TASK_GROUP, "w1", {store.tasks_key(stage, 0): ">"}, count=1)
        entry_id = s(delivered[0][1][0][0])
        groups.append(sessions.ClaimGroup(stage, upstream[stage], 0, [(entry_id, sub.id, 1)],
                                          store.pipeline.queue(stage)))
    call = sessions.claim_groups(store.keys, groups, worker_id="w1", now_ms=now_ms())
    replies = await redisio.execute(store.client, [call])
    assert [s(r[0]) for r in replies[0]] == ["ok", "ok", "ok"]
    rec = await store.client.hmget(store.keys.wf(sub.id), ["state", "thinker", "talker", "code2wav", "talker:replica"])
    assert [s(x) for x in rec] == ["running", "running", "waiting_input", "waiting_input", "w1"]
    entries = await store.client.xrange(store.keys.log(sub.id))
    assert len(entries) == 2                # submit's, the claim's
    events = await store.read_log(sub.id)
    claim_id = s(entries[1][0])
    assert [eid for eid, _ in events][1:] == [claim_id, f"{claim_id}.1", f"{claim_id}.2", f"{claim_id}.3"]
    assert [(e["t"], e.get("state") or e["stage"]) for _, e in events] == [
        ("state", "pending"), ("state", "running"), ("stage", "thinker"), ("stage", "talker"), ("stage", "code2wav")]
    assert events[3][1] == {"t": "stage", "stage": "talker", "status": "waiting_input", "attempt": "1", "replica": "w1"}
    # read after an event inside the entry: the rest of it, and nothing twice
    assert [eid for eid, _ in await store.read_log(sub.id, after=f"{claim_id}.1")] == [f"{claim_id}.2", f"{claim_id}.3"]
    assert await store.read_log(sub.id, after=f"{claim_id}.3") == []
    assert (await store.last_event(sub.id))[0] == f"{claim_id}.3"


async def test_packed_chunks_and_table_chunks_make_one_edge_entry_a_consumer_decodes(store) -> None:
    """Op 'P' carries a chunk the worker packed; the script appends it to the edge entry as it is,
    beside chunks it packs itself ('E'): the entry's `m` is one msgpack array of them all, in order,
    a 16-bit array header past 15 chunks."""
    sub = await store.submit(request())
    await claim_next(store, "thinker")
    fields = lambda n: ["seq", n, "a", 1, "d", f"c{n}" * n]  # noqa: E731
    ops = [[n, *(["P", "talker", msgpack.packb(fields(n), use_bin_type=False)] if n % 3 else ["E", "talker", fields(n)])]
           for n in range(1, 21)]
    res = await redisio.script(store.client, "emit", emit_keys(store, sub.id, "thinker", ("talker",)),
                               ["thinker", 1, "", now_ms(), sub.id, msgpack.packb(ops, use_bin_type=False)])
    assert s(res) == "ok"
    (entry,) = await store.client.xrange(store.keys.edge(sub.id, "thinker", "talker"))
    assert entry[1][b"m"][:3] == bytes([0xdc, 0, 20])
    chunks = msgpack.unpackb(entry[1][b"m"], raw=True)
    assert chunks == [[x.encode() if isinstance(x, str) else x for x in fields(n)] for n in range(1, 21)]
    bad = msgpack.packb([[21, "P", "talker", ""]], use_bin_type=False)
    with pytest.raises(Exception, match="op P needs a packed chunk"):
        await redisio.script(store.client, "emit", emit_keys(store, sub.id, "thinker", ("talker",)),
                             ["thinker", 1, "", now_ms(), sub.id, bad])


async def test_calls_refused_for_an_inbox_may_land_in_any_order_without_a_false_gap(store) -> None:
    """Call A (step 1) is refused for the talker's inbox, call B (step 2) waits its turn; A is sent
    again and lands, and call C (step 3) arrives before B's second sending: C waits its turn too (the
    step before it is on its way: not a hole), then B and C land. Found by bench/dataplane.py, whose
    1 MiB chunks through Redis failed their producer with 'an earlier write was lost'."""
    sub = await store.submit(request())
    await claim_next(store, "thinker")
    await bind_talker(store, sub.id)
    keys = emit_keys(store, sub.id, "thinker", ("talker",))

    def call(n: int, kk: list[str]) -> Any:      # step 1 has a chunk for the talker, the others text only
        chunk = ["E", "talker", ["seq", n, "a", 1, "d", f"c{n}"]] if n == 1 else []
        steps = msgpack.packb([[n, "T", f"w{n} ", "", *chunk]], use_bin_type=False)
        return redisio.script(store.client, "emit", kk, ["thinker", 1, "", now_ms(), sub.id, steps])

    wait_field = "thinker:inbox_wait"
    assert [s(x) for x in await call(1, keys)] == ["inbox", "talker", "w1"]         # A refused
    assert [s(x) for x in await call(2, keys)] == ["inbox", "", ""]                 # B waits its turn
    keys = [*keys, store.keys.inbox("w1", 0)]
    assert s(await call(1, keys)) == "ok"                                           # A again
    assert [s(x) for x in await call(3, keys)] == ["inbox", "", ""]                 # C before B: waits
    assert (await store.client.hget(store.keys.stages(sub.id), wait_field)).startswith(b"1:3:")
    assert s(await call(2, keys)) == "ok"                                           # B again
    assert s(await call(3, keys)) == "ok"                                           # C again
    assert await store.text(sub.id, "thinker") == "w1 w2 w3 "
    assert await store.client.hget(store.keys.stages(sub.id), wait_field) is None   # nothing waits any more
    # and a step past a real hole is still one
    assert s(await call(5, keys)) == "gap"
    # a refused call that is never sent again (its sending failed: the attempt is ending) holds the
    # others only for a while: then a step after it is a hole, and the marker goes
    sk = store.keys.stages(sub.id)
    await store.client.hset(sk, wait_field, f"1:9:{now_ms()}")
    assert [s(x) for x in await call(5, keys)] == ["inbox", "", ""]                 # waits its turn
    await store.client.hset(sk, wait_field, f"1:9:{now_ms() - 6_000}")
    assert s(await call(5, keys)) == "gap"                                          # waited long enough
    assert s(await call(4, keys)) == "ok"
    assert await store.client.hget(sk, wait_field) is None
    # a call waiting its turn, sent again and again (a finish retried every few seconds), does not
    # keep the wait alive: the marker keeps the time of the last refusal for an inbox
    set_ms = now_ms() - 4_000
    await store.client.hset(sk, wait_field, f"1:9:{set_ms}")
    for _ in range(3):
        assert [s(x) for x in await call(6, keys)] == ["inbox", "", ""]
    assert s(await store.client.hget(sk, wait_field)) == f"1:9:{set_ms}"
    await store.client.hset(sk, wait_field, f"1:9:{set_ms - 2_000}")             # lapsed: 6 s ago
    assert s(await call(6, keys)) == "gap"


async def test_claim_is_idempotent_for_the_same_replica_only(store) -> None:
    sub = await store.submit(request(modalities=["text"]))
    reply = await store.client.xreadgroup(TASK_GROUP, "w1", {store.tasks_key("thinker", 0): ">"}, count=1)
    entry_id = s(reply[0][1][0][0])
    def claim(worker: str):
        return redisio.script(store.client, "claim", claim_keys(store, "thinker", sub.id),
                            [store.settings.prefix, TASK_GROUP, worker, now_ms(), "", "thinker", entry_id, sub.id, "1"])
    assert s((await claim("w1"))[0][0]) == "ok"
    assert s((await claim("w1"))[0][0]) == "ok"        # a retried call after a lost reply
    assert [s(x) for x in (await claim("w2"))[0]] == ["drop", "held", "w1"]
    # the task stays, pending for the replica that runs it (not for w2, not acked)
    pending = await store.client.xpending_range(store.tasks_key("thinker", 0), TASK_GROUP, min="-", max="+", count=10)
    assert [(s(p["message_id"]), s(p["consumer"])) for p in pending] == [(entry_id, "w1")]


async def test_a_task_delivered_again_while_its_session_runs_stays_findable_by_the_reconciler(store) -> None:
    """A failover can lose a task's delivery and keep its claim (the claim, sent again, bound the
    stage on the promoted replica): the session runs on w1 with its task pending for nobody, and
    the stream delivers the task again, to w2. w2's claim leaves it pending for w1, so when w1
    dies the reconciler's dead-worker sweep still finds the session and retries it. (Acked there,
    the stage would stay running forever and its consumers time out: cluster soak, CI.)"""
    sub = await store.submit(request(modalities=["text"]))
    tasks = store.tasks_key("thinker", 0)
    entry_id, res = await claim_next(store, "thinker", "w1")
    assert res[0] == "ok"
    await store.client.xack(tasks, TASK_GROUP, entry_id)                       # the delivery, lost:
    await store.client.execute_command("XGROUP", "SETID", tasks, TASK_GROUP, "0")   # pending for nobody, unread
    again, res = await claim_next(store, "thinker", "w2")
    assert again == entry_id and res[:2] == ["drop", "held"]
    rec = Reconciler(settings=store.settings, pipeline=store.pipeline, redis_url="unused")
    rec.redis = store.client
    await store.client.zadd(store.keys.workers, {"w1": 1})                    # w1's lease lapses
    assert await rec.sweeps.dead_workers() == 1
    stages = await store.client.hgetall(store.keys.stages(sub.id))
    assert s(stages[b"thinker"]) == "pending" and s(stages[b"thinker:attempt"]) == "2"


async def test_finish_of_a_fenced_session_acks_but_reports_nothing(store) -> None:
    sub = await store.submit(request(modalities=["text"]))
    entry_id, _ = await claim_next(store, "thinker")
    await store.abort(sub.id)
    wf = store.keys.wf(sub.id)
    res = await redisio.script(store.client, "finish",
                             [wf, store.tasks_key("thinker", 0), store.keys.events(0), f"{wf}:stages", f"{wf}:log"],
                             [TASK_GROUP, entry_id, "thinker", 1, "done", "{}", "1", now_ms(), 0, ""])
    assert s(res) == "fenced"
    assert (await store.client.xpending(store.tasks_key("thinker", 0), TASK_GROUP))["pending"] == 0
    assert await store.client.xlen(store.keys.events(0)) == 0


async def test_finish_of_a_session_whose_claim_was_lost_leaves_its_task_to_be_claimed_again(store) -> None:
    """A primary that fails over after answering a claim can lose the claim's write: the session ran,
    every write of it was fenced (its stage is `pending`, not bound). Its finish must not ack the task
    (the stage would stay pending with no task, and its consumers starve): the task stays pending for
    the worker, whose orphan audit claims it again, and that claim binds the stage."""
    sub = await store.submit(request(modalities=["text"]))
    entry_id, _ = await claim_next(store, "thinker")
    wf = store.keys.wf(sub.id)
    await store.client.hset(store.keys.stages(sub.id), mapping={"thinker": "pending", "thinker:replica": ""})   # the claim, lost
    assert await emit(store, sub.id, "thinker", 1, 1, "x") == "fenced"
    res = await redisio.script(store.client, "finish",
                               [wf, store.tasks_key("thinker", 0), store.keys.events(0), f"{wf}:stages", f"{wf}:log"],
                               [TASK_GROUP, entry_id, "thinker", 1, "failed", "fenced", "1", now_ms(), 0, ""])
    assert s(res) == "fenced"
    assert (await store.client.xpending(store.tasks_key("thinker", 0), TASK_GROUP))["pending"] == 1
    assert await store.client.xlen(store.keys.events(0)) == 0
    res = await redisio.script(store.client, "claim", claim_keys(store, "thinker", sub.id),
                               [store.settings.prefix, TASK_GROUP, "w1", now_ms(), "", "thinker", entry_id, sub.id, "1"])
    assert s(res[0][0]) == "ok"                                     # claimed again (the orphan audit's claim)
    assert await emit(store, sub.id, "thinker", 1, 1, "x") == "ok"


async def test_abort_is_terminal_once(store) -> None:
    sub = await store.submit(request())
    assert await store.abort(sub.id) == "aborted"
    assert await store.abort(sub.id) == "aborted"       # already terminal: unchanged
    entries = await store.read_log(sub.id)
    assert [f["state"] for _, f in entries if f["t"] == "terminal"] == ["aborted"]
    assert await store.client.zscore(store.keys.inflight(0), sub.id) is None
    assert s(await store.client.get(store.keys.tomb(sub.id))) == "aborted"


async def test_a_session_learns_its_consumers_inbox_and_declares_it_from_then_on(store) -> None:
    """The first emit of a producer whose consumer is bound to a replica it does not know is refused
    (nothing written) and sent again declaring that replica's inbox; the worker's other sessions
    declare it from the start, so they are never refused."""
    from omniflow.engine.session import Session
    from omniflow.engine.session.consumers import Consumers
    from omniflow.storage.batcher import Batcher

    batcher, consumers = Batcher(store.client), Consumers()

    async def run_thinker(n: int) -> int:
        sub = await store.submit(request())
        await claim_next(store, "thinker")
        await bind_talker(store, sub.id)
        session = Session(wf_id=sub.id, stage="thinker", attempt=1, input={}, params={}, finals=("thinker",),
                          downstream=("talker",), resume_seq=0, _batcher=batcher, _keys=store.keys,
                          required=("thinker", "talker", "code2wav"), _consumers=consumers)
        before = batcher.commands
        await session.emit(text="hi", data=f"chunk {n}")
        await session.flush()
        inbox = await store.client.xrange(store.keys.inbox("w1", 0))
        assert [e for _, e in inbox if e[b"wf"] == sub.id.encode()], "the chunk reached the consumer's inbox"
        assert await store.text(sub.id, "thinker") == "hi"
        return batcher.commands - before

    assert await run_thinker(1) == 2            # refused once, then sent declaring w1's inbox
    assert consumers.of(("talker",), 0) == {"talker": ("w1",)}
    assert await run_thinker(2) == 1            # declared from the start


def test_each_script_carries_only_the_helpers_it_uses() -> None:
    """`_lib.lua` is cut into its top-level statements and a script gets those it uses, directly or
    through another (omniflow/storage/scripts.py): nothing of the file is lost by the cut, a helper
    a script calls is there, and one it never calls is not."""
    from omniflow.storage.scripts import SCRIPTS, _chunks, _read

    lib = _read("_lib.lua")
    assert "\n".join(text for _, text in _chunks(lib)) == lib.rstrip("\n")
    assert "local function finalize(" in SCRIPTS["emit"].source        # the completing finish calls it
    assert "local function finalize(" not in SCRIPTS["claim"].source
    assert "local function key(" in SCRIPTS["claim"].source and "local DECLARED" in SCRIPTS["claim"].source
    assert len(SCRIPTS["claim"].source) < len(SCRIPTS["emit"].source) / 3


async def _xrange_calls(store: Store) -> int:
    return int((await store.client.info("commandstats")).get("cmdstat_xrange", {}).get("calls", 0))


async def _claim_talker(store: Store, wf_id: str, entry_id: str) -> list:
    reply = await redisio.script(store.client, "claim", claim_keys(store, "talker", wf_id, ("thinker",)),
                                 [store.settings.prefix, TASK_GROUP, "w1", now_ms(), "thinker", "talker", entry_id, wf_id, "1"])
    assert s(reply[0][0]) == "ok"
    return [(s(src), [(s(eid), msgpack.unpackb(dict(zip(f[::2], f[1::2]))[b"m"])) for eid, f in entries])
            for src, entries in reply[0][6]]


async def test_a_claim_reads_the_edge_of_an_upstream_stage_only_once_it_has_written_to_it(store) -> None:
    """A consuming stage claimed before its producer stored a step (the pre-submitted Talker, at
    submit time) has nothing to catch up on: its claim answers an empty catch-up without reading the
    edge. Once the producer stored a step, or finished (done with no step: the end of stream alone),
    the claim reads the edge (a claim sent again answers again, with the catch-up as it is then)."""
    sub = await store.submit(request())
    delivered = await store.client.xreadgroup(TASK_GROUP, "w1", {store.tasks_key("talker", 0): ">"}, count=1)
    talker_task = s(delivered[0][1][0][0])
    before = await _xrange_calls(store)
    assert await _claim_talker(store, sub.id, talker_task) == [("thinker", [])]
    assert await _xrange_calls(store) == before, "the claim read an edge nothing was written to"
    entry_id, _ = await claim_next(store, "thinker")
    steps = msgpack.packb([[1, "E", "talker", ["seq", 1, "a", 1, "d", "c1"]]], use_bin_type=False)
    keys = [*emit_keys(store, sub.id, "thinker", ("talker",)), store.keys.inbox("w1", 0)]   # the talker's replica
    assert s(await redisio.script(store.client, "emit", keys, ["thinker", 1, "", now_ms(), sub.id, steps])) == "ok"
    (src, entries), = await _claim_talker(store, sub.id, talker_task)
    assert src == "thinker" and [chunks for _, chunks in entries] == [[["seq", 1, "a", 1, "d", "c1"]]]
    assert await _xrange_calls(store) == before + 1

    # done with no step: only the end of stream is on the edge, and it is read
    other = await store.submit(request())
    delivered = await store.client.xreadgroup(TASK_GROUP, "w2", {store.tasks_key("thinker", 0): ">"}, count=1)
    thinker_task = s(delivered[0][1][0][0])
    await redisio.script(store.client, "claim", claim_keys(store, "thinker", other.id),
                         [store.settings.prefix, TASK_GROUP, "w2", now_ms(), "", "thinker", thinker_task, other.id, "1"])
    wf = store.keys.wf(other.id)
    assert s(await redisio.script(store.client, "finish",
                                  [wf, store.tasks_key("thinker", 0), store.keys.events(0), f"{wf}:stages", f"{wf}:log",
                                   store.keys.edge(other.id, "thinker", "talker")],
                                  [TASK_GROUP, thinker_task, "thinker", 1, "done", "{}", "1", now_ms(), 0, "talker"])) == "ok"
    delivered = await store.client.xreadgroup(TASK_GROUP, "w1", {store.tasks_key("talker", 0): ">"}, count=1)
    (src, entries), = await _claim_talker(store, other.id, s(delivered[0][1][0][0]))
    assert [chunks for _, chunks in entries] == [[["eos", "1", "seq", "0", "a", "1"]]]   # (ARGV: strings)


def test_a_const_table_is_built_once_and_never_written() -> None:
    """`--@const` tables are shared by every call of a library function (scripts.py): the library is
    refused when a script writes into one."""
    from omniflow.storage import scripts

    src = scripts.SCRIPTS["emit"].source
    per_call = src[src.index("  return function()"):]
    assert "FINISH_REC = {" not in per_call and "local FINISH_REC = {" in src     # built once
    scripts._check_const({"T"}, "local T = {'a'}\nlocal x = T[1]\nif T[1] == x then return end")
    for bad in ("T[1] = 'b'", "T.x = 1", "T = {}", "table.insert(T, 'c')"):
        with pytest.raises(ValueError, match="T is a --@const table"):
            scripts._check_const({"T"}, f"local T = {{'a'}}\n{bad}")


async def test_trim_tasks_deletes_only_what_every_group_delivered_and_acked(store) -> None:
    """A finish acks its task and leaves the entry; trim_tasks.lua deletes an entry once it is
    delivered and acked, never one still queued or held (a lapsed worker's tasks are re-queued
    from there), and XINFO GROUPS' lag stays known (queue depth, KEDA)."""
    from omniflow.storage.transitions.housekeeping import trim_tasks

    for i in range(3):
        await store.submit(request(f"trim {i}"))
    stream = store.tasks_key("thinker", 0)
    other = store.tasks_key("talker", 0)
    await store.client.xgroup_create(other, "audit", id="0")         # a second group that read nothing

    async def trim(*streams: str) -> int:
        return int((await redisio.execute(store.client, [trim_tasks(streams)]))[0])

    got = await store.client.xreadgroup(TASK_GROUP, "w1", {stream: ">"}, count=2)
    first, second = (s(entry_id) for entry_id, _ in got[0][1])
    assert await trim(stream) == 0                                   # delivered, not acked
    await store.client.xack(stream, TASK_GROUP, first)
    assert await trim(stream, other) == 1                            # the first only: the second is held
    assert [s(e) for e, _ in await store.client.xrange(stream)][0] == second
    await store.client.xack(stream, TASK_GROUP, second)
    assert await trim(stream) == 1 and await store.client.xlen(stream) == 1     # the third is queued
    group = next(g for g in await store.client.xinfo_groups(stream) if s(g["name"]) == TASK_GROUP)
    assert group["lag"] == 1 and group["pending"] == 0
    third = (await store.client.xreadgroup(TASK_GROUP, "w1", {stream: ">"}, count=1))[0][1][0][0]
    await store.client.xack(stream, TASK_GROUP, third)
    assert await trim(stream) == 1 and await store.client.xlen(stream) == 0
    # the talker's stream: its `workers` group delivered nothing, "audit" read nothing either
    assert await store.client.xlen(other) == 3
    await store.client.xreadgroup(TASK_GROUP, "w1", {other: ">"}, count=3)
    await store.client.xack(other, TASK_GROUP, *[e for e, _ in await store.client.xrange(other)])
    assert await trim(other) == 0                                    # "audit" has not read them
    assert await trim(store.tasks_key("nowhere", 0)) == 0             # no such stream
