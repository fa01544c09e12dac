"""Streamed input: a workflow submitted with audio input starts at the pipeline's audio stage, which
reads the client's audio from `@input` while more is appended (`Store.append_input`); text input of
the same pipeline skips that stage."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omniflow.errors import InputClosed, InvalidRequest
from omniflow.models import AudioInput, SubmitRequest, WorkflowInput
from omniflow.pipeline import build_pipeline

from conftest import toy_audio_spec, toy_spec

pytestmark = pytest.mark.timeout(60)
RATE = 16000


def audio_request(**kw: object) -> SubmitRequest:
    return SubmitRequest(input=WorkflowInput(audio=AudioInput(sample_rate=RATE)), **kw)  # type: ignore[arg-type]


def test_plan_by_input_kind() -> None:
    pipe = build_pipeline(toy_audio_spec())
    text, audio = pipe.plan(), pipe.plan(input_kind="audio")
    assert text.stages == ("thinker", "talker", "code2wav") and text.admit == text.stages and not text.input_stage
    assert audio.stages == ("asr", "thinker", "talker", "code2wav") and audio.input_stage == "asr"
    assert pipe.sources("asr") == ("@input",) and pipe.sources("thinker") == ("asr",)
    with pytest.raises(InvalidRequest, match="takes text input, not audio"):
        build_pipeline(toy_spec()).plan(input_kind="audio")


def test_inputs_name_known_stages_and_any_stage_may_take_text() -> None:
    from omniflow.errors import PipelineError

    spec = toy_audio_spec()
    spec["inputs"] = {"text": "talker", "audio": "asr"}       # text spoken as is: the Thinker is skipped
    assert build_pipeline(spec).plan().stages == ("talker", "code2wav")
    spec["inputs"] = {"audio": "nope"}
    with pytest.raises(PipelineError, match="inputs.audio: unknown stage 'nope'"):
        build_pipeline(spec)


def test_workflow_input_needs_text_or_audio() -> None:
    with pytest.raises(ValueError, match="give the prompt"):
        WorkflowInput()


async def test_audio_appended_while_running_is_heard_and_answered(engine_factory) -> None:
    async with engine_factory(toy_audio_spec()) as engine:
        store = engine.store
        wf = (await store.submit(audio_request())).id
        second = np.zeros(RATE // 2, dtype=np.int16) + 100        # half a second: one toy word
        await store.append_input(wf, [second, second])
        # recognition starts before the input ends: both words are out before the last append
        await asyncio.wait_for(_until_emitted(engine, wf, "asr", 2), 10)
        await store.append_input(wf, second, final=True)
        doc = await store.wait(wf, timeout_s=20)
        assert doc["state"] == "completed", doc
        assert doc["outputs"]["thinker"]["text"].startswith("You said: hello omniflow please")
        assert doc["stages"]["asr"]["usage"]["audio_seconds"] == 1.5
        with pytest.raises(InputClosed, match="completed: it takes no more input"):
            await store.append_input(wf, second)


async def test_text_input_skips_the_audio_stage(engine_factory) -> None:
    async with engine_factory(toy_audio_spec()) as engine:
        wf = (await engine.store.submit(SubmitRequest(input=WorkflowInput(text="hi there")))).id
        doc = await engine.store.wait(wf, timeout_s=20)
        assert doc["state"] == "completed" and "asr" not in doc["stages"]
        assert doc["stages"]["thinker"]["status"] == "done"
        with pytest.raises(InvalidRequest, match="no streamed input"):
            await engine.store.append_input(wf, np.zeros(10, dtype=np.int16))


async def test_a_killed_asr_worker_replays_the_input_log(engine_factory) -> None:
    """The input is durable: an ASR attempt that fails mid-stream is retried from the edge log."""
    async with engine_factory(toy_audio_spec(asr={"fail_at_step": 2, "fail_attempts": 1})) as engine:
        wf = (await engine.store.submit(audio_request())).id
        await engine.store.append_input(wf, [np.ones(RATE, dtype=np.int16)] * 2, final=True)
        doc = await engine.store.wait(wf, timeout_s=20)
        assert doc["state"] == "completed" and doc["stages"]["asr"]["attempt"] == 2
        assert doc["outputs"]["thinker"]["text"].startswith("You said: hello omniflow please tell")


async def test_bad_audio_fails_the_workflow_not_the_worker(engine_factory) -> None:
    async with engine_factory(toy_audio_spec()) as engine:
        empty = (await engine.store.submit(audio_request())).id
        await engine.store.append_input(empty, final=True)
        doc = await engine.store.wait(empty, timeout_s=20)
        assert doc["state"] == "failed" and "no audio" in doc["error"]
        with pytest.raises(InvalidRequest, match="int16 mono"):
            await engine.store.append_input(empty, np.zeros(4, dtype=np.float32))
        ok = (await engine.store.submit(audio_request())).id       # the worker goes on
        await engine.store.append_input(ok, np.ones(RATE, dtype=np.int16), final=True)
        assert (await engine.store.wait(ok, timeout_s=20))["state"] == "completed"


async def _until_emitted(engine, wf: str, stage: str, steps: int) -> None:  # type: ignore[no-untyped-def]
    while int(await engine.redis.hget(engine.store.keys.stages(wf), f"{stage}:seq") or 0) < steps:
        await asyncio.sleep(0.02)


async def test_input_after_its_end_is_refused(engine_factory) -> None:
    async with engine_factory(toy_audio_spec(), workers=False) as engine:
        wf = (await engine.store.submit(audio_request())).id
        assert await engine.store.append_input(wf, [np.ones(8, dtype=np.int16)] * 3) == 3
        assert await engine.store.append_input(wf, final=True) == 4
        with pytest.raises(InputClosed, match="input has ended"):
            await engine.store.append_input(wf, np.ones(8, dtype=np.int16))
        edge = await engine.redis.xrange(engine.store.keys.input_edge(wf, "asr"))
        assert len(edge) == 2          # one entry per append

