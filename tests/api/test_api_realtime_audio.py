"""Realtime audio turns over `client.realtime.connect()` (the official `openai` client) against the toy
pipeline that takes audio (ToyASR -> Thinker -> Talker -> Code2Wav): the input buffer streams into the
turn's workflow while the user speaks, a commit ends it, the transcript arrives as
`conversation.item.input_audio_transcription.completed`, the answer as transcript deltas and pcm16 at
24 kHz; clear, barge-in by a new commit, bad and out-of-order events, a killed ASR worker and a
reconnect mid-answer."""
from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_audio_spec
from helpers import eventually, expected_text
from test_api_realtime import MODEL, TESTS, client, of, pcm_of, until

pytestmark = pytest.mark.timeout(90)
CHUNK_MS = 100


def speech(seconds: float) -> list[str]:
    """`seconds` of pcm16 at 24 kHz in 100 ms appends (base64), as a microphone sends it."""
    n = int(seconds * 24000)
    pcm = (np.sin(np.arange(n) / 5) * 5000).astype("<i2").tobytes()
    step = 24000 * 2 * CHUNK_MS // 1000
    return [base64.b64encode(pcm[i:i + step]).decode() for i in range(0, len(pcm), step)]


async def speak(conn, seconds: float) -> None:
    for chunk in speech(seconds):
        await conn.input_audio_buffer.append(audio=chunk)


async def test_an_audio_turn_is_heard_while_spoken_and_answered(api_factory) -> None:
    async with api_factory(toy_audio_spec(thinker={"max_words": 10})) as (engine, server), client(server) as oai:
        async with oai.realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await speak(conn, 1.0)
            # the turn's workflow exists and its ASR has heard the first words before the commit
            await eventually(lambda: _heard_words(engine, 2), timeout_s=10, what="words heard before the commit")
            await speak(conn, 0.5)
            await conn.input_audio_buffer.commit()
            events = await until(conn, "conversation.item.done")
            await conn.response.create()
            events = await until(conn, "response.done", seen=events)
            if not of(events, "conversation.item.input_audio_transcription.completed"):
                events = await until(conn, "conversation.item.input_audio_transcription.completed", seen=events)
    committed = of(events, "input_audio_buffer.committed")[0]
    heard = of(events, "conversation.item.input_audio_transcription.completed")[0]
    assert heard.item_id == committed.item_id and heard.transcript == "hello omniflow please"
    assert heard.usage.seconds == pytest.approx(1.5)
    assert events[-1 if events[-1].type == "response.done" else -2].response.status in ("completed",)
    transcript = "".join(e.delta for e in of(events, "response.output_audio_transcript.delta"))
    assert transcript == expected_text("hello omniflow please", 10)
    assert pcm_of(events).size > 0 and len(await engine.store.list()) == 1       # one workflow: the turn


async def test_clear_aborts_the_turn_and_the_next_append_starts_another(api_factory) -> None:
    async with api_factory(toy_audio_spec()) as (engine, server), client(server) as oai:
        async with oai.realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await speak(conn, 0.5)
            await eventually(lambda: _count(engine, 1), timeout_s=10, what="the turn's workflow")
            await conn.input_audio_buffer.clear()
            await until(conn, "input_audio_buffer.cleared")
            first = (await engine.store.list())[0]["id"]
            await eventually(lambda: _state(engine, first, "aborted"), timeout_s=10, what="the cleared turn aborted")
            await speak(conn, 0.5)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"output_modalities": ["text"]})
            events = await until(conn, "response.done")
    assert events[-1].response.status == "completed"
    assert "".join(e.delta for e in of(events, "response.output_text.delta")).startswith("You said: hello -")


async def test_new_speech_while_a_response_plays_interrupts_it(api_factory) -> None:
    spec = toy_audio_spec(thinker={"token_delay_s": 0.1, "max_words": 40})
    async with api_factory(spec) as (engine, server), client(server) as oai:
        async with oai.realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await speak(conn, 0.5)
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first = await until(conn, "response.output_audio.delta")
            await speak(conn, 1.0)                      # the user talks over the answer, and commits
            await conn.input_audio_buffer.commit()
            await conn.response.create()                # waits for the interrupted turn to end
            first = await until(conn, "response.done", seen=first)
            second = await until(conn, "response.done")
    assert first[-1].response.status == "cancelled"
    assert second[-1].response.status == "completed"
    transcript = "".join(e.delta for e in of(second, "response.output_audio_transcript.delta"))
    assert transcript == expected_text("hello omniflow", 40)
    states = sorted(w["state"] for w in await engine.store.list())
    assert states == ["aborted", "completed"]


async def test_bad_and_out_of_order_audio_events_get_errors_and_the_connection_stays_usable(api_factory) -> None:
    async with api_factory(toy_audio_spec()) as (_engine, server), client(server) as oai:
        async with oai.realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.input_audio_buffer.commit(event_id="early")                 # nothing appended
            err = (await until(conn, "error"))[-1].error
            assert err.code == "input_audio_buffer_commit_empty" and err.event_id == "early"
            await conn.input_audio_buffer.append(audio="%%% not base64")
            assert (await until(conn, "error"))[-1].error.param == "audio"
            await conn.input_audio_buffer.append(audio=base64.b64encode(b"\x01\x02\x03").decode())
            assert "whole pcm16 samples" in (await until(conn, "error"))[-1].error.message
            await conn.response.cancel()
            assert (await until(conn, "error"))[-1].error.code == "response_cancel_not_active"
            await conn.response.create()
            assert (await until(conn, "error"))[-1].error.code == "no_input"
            await conn.send({"type": "input_audio_buffer.append"})                 # no audio field
            assert (await until(conn, "error"))[-1].error.param == "audio"
            await speak(conn, 0.5)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"output_modalities": ["text"]})
            events = await until(conn, "response.done")
    assert events[-1].response.status == "completed"


async def test_an_audio_turn_survives_its_asr_worker_being_killed(api_factory, tmp_path: Path) -> None:
    spec = toy_audio_spec(asr={"chunk_delay_s": 0.05}, thinker={"max_words": 12})
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    procs: list[subprocess.Popen[bytes]] = []
    async with api_factory(spec, workers=False, engine_settings={"lease_timeout_s": 1.0}) as (engine, server):
        for stage in ("thinker", "talker", "code2wav"):
            await engine.add_worker(stage)
        st = engine.settings
        env = {**os.environ, "OMNIFLOW_REDIS_URL": engine.url, "OMNIFLOW_PREFIX": st.prefix,
               "OMNIFLOW_PIPELINE": str(pipeline), "OMNIFLOW_HEARTBEAT_INTERVAL_S": str(st.heartbeat_interval_s),
               "OMNIFLOW_LEASE_TIMEOUT_S": str(st.lease_timeout_s), "OMNIFLOW_BLOCK_MS": "1000",
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}

        def asr() -> subprocess.Popen[bytes]:
            proc = subprocess.Popen([sys.executable, "-m", "omniflow.cli", "worker", "--stage", "asr"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=(tmp_path / f"w{len(procs)}.log").open("wb"))
            procs.append(proc)
            return proc

        try:
            first = asr()
            await eventually(lambda: _live(engine, "asr"), timeout_s=60, what="the asr worker up")
            async with client(server) as oai, oai.realtime.connect(model=MODEL) as conn:
                await until(conn, "session.created")
                await speak(conn, 1.0)
                await eventually(lambda: _heard_words(engine, 1), timeout_s=20, what="a word heard")
                first.send_signal(signal.SIGKILL)          # mid-turn: the user is still speaking
                first.wait(10)
                asr()
                await speak(conn, 1.0)
                await conn.input_audio_buffer.commit()
                await conn.response.create()
                events = await until(conn, "response.done", timeout_s=60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(5)
        doc = await engine.store.document((await engine.store.list())[0]["id"])
    assert events[-1].response.status == "completed" and doc["stages"]["asr"]["attempt"] == 2
    transcript = "".join(e.delta for e in of(events, "response.output_audio_transcript.delta"))
    assert transcript == expected_text("hello omniflow please tell", 12)       # every word heard once


async def test_a_reconnect_mid_answer_gets_the_rest_of_the_audio_turn(api_factory) -> None:
    spec = toy_audio_spec(thinker={"token_delay_s": 0.05, "max_words": 20})
    async with api_factory(spec) as (_engine, server), client(server) as oai:
        async with oai.realtime.connect(model=MODEL) as conn:
            sid = (await until(conn, "session.created"))[-1].session.id
            await speak(conn, 1.0)
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first = await until(conn, "response.output_audio_transcript.delta")
        last = first[-1].event_id
        async with oai.realtime.connect(model=MODEL, extra_query={"session_id": sid, "last_event_id": last}) as conn:
            rest = await until(conn, "response.done")
    whole = [e for e in first + rest if e.event_id.startswith("evt_")]
    assert [int(e.event_id.rsplit("_", 1)[1]) for e in whole] == list(range(len(whole)))
    transcript = "".join(e.delta for e in of(whole, "response.output_audio_transcript.delta"))
    assert transcript == expected_text("hello omniflow", 20)


async def _heard_words(engine, n: int) -> bool:
    listed = await engine.store.list()
    if not listed:
        return False
    raw = await engine.redis.hget(engine.store.keys.stages(listed[0]["id"]), "asr:seq")
    return int(raw or 0) >= n


async def _count(engine, n: int) -> bool:
    return len(await engine.store.list()) >= n


async def _state(engine, wf_id: str, state: str) -> bool:
    return (await engine.store.document(wf_id))["state"] == state


async def _live(engine, stage: str) -> bool:
    return (await engine.store.live_workers()).get(stage, 0) > 0


_ = asyncio
