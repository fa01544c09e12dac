"""The realtime protocol's pure parts: event parsing, the session configuration, the session state
machine and a turn's numbered events (no sockets, no Redis)."""
from __future__ import annotations

import base64
import json

import pytest

from omniflow.api.realtime.config import Capabilities, SessionConfig, apply_update
from omniflow.api.realtime.events import ProtocolError, error_event, parse_client_event
from omniflow.api.realtime.records import CancelTurn, ResponseStatus, Save, Send, SessionState, StartTurn
from omniflow.api.realtime.state import MIN_COMMIT_BYTES, RealtimeSession
from omniflow.api.realtime.turn import TurnEvents, event_id, parse_event_id

TTL_S = 600
VOICES = {"alloy": "joe", "echo": "joe", "joe": "joe"}


def caps(**overrides) -> Capabilities:
    base = dict(model="omni-toy", outputs=frozenset({"text", "audio"}), voices=VOICES, knobs=frozenset({"speed"}),
                max_buffer_bytes=48_000 * 2, max_prompt_chars=100)
    base.update(overrides)
    return Capabilities(**base)


def handle(session: RealtimeSession, event: dict) -> list:
    return session.handle(parse_client_event(json.dumps(event)), ttl_s=TTL_S)


def sent(effects: list, kind: str | None = None) -> list[dict]:
    events = [e.event for e in effects if isinstance(e, Send)]
    return [e for e in events if kind is None or e["type"] == kind]


def refused(session: RealtimeSession, event: dict) -> ProtocolError:
    before = session.state.model_dump_json()
    with pytest.raises(ProtocolError) as info:
        handle(session, event)
    assert session.state.model_dump_json() == before          # a refused event changes nothing
    return info.value


def user_text(text: str = "hello there", **extra) -> dict:
    return {"type": "conversation.item.create", "event_id": "c1",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **extra}}


@pytest.mark.parametrize("raw, code", [
    ("not json", "invalid_json"), ("[1, 2]", "invalid_event"), ('{"event_id": "x"}', "invalid_event"),
    ('{"type": "conversation.item.delete", "event_id": "e9"}', "unknown_event_type"),
    ('{"type": "input_audio_buffer.append", "event_id": "e7"}', "invalid_value"),
])
def test_malformed_events_are_protocol_errors_naming_the_event(raw: str, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_event(raw)
    assert info.value.code == code
    if '"event_id": "e' in raw:
        assert info.value.event_id == json.loads(raw)["event_id"]
    event = error_event(info.value)
    assert event["type"] == "error" and event["error"]["code"] == code and event["event_id"].startswith("event_")
    assert event["error"]["type"] == "invalid_request_error"


def test_session_update_changes_only_what_it_names_and_is_all_or_nothing() -> None:
    config = SessionConfig.default(caps())
    assert config.output_modalities == ["audio"]
    config = apply_update(config, {"type": "realtime", "output_modalities": ["text"], "audio": {"output": {"voice": "echo"}}},
                          caps())
    assert config.output_modalities == ["text"] and config.voice == "echo" and config.speed == 1.0
    config = apply_update(config, {"type": "realtime", "audio": {"output": {"speed": 1.5}}}, caps())
    assert config.voice == "echo" and config.speed == 1.5 and config.output_modalities == ["text"]
    for bad, param in [
        ({"audio": {"output": {"voice": "nobody"}}}, "session.audio.output.voice"),
        ({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, "session.audio.output.format.type"),
        ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.output.format.rate"),
        ({"audio": {"output": {"speed": 9}}}, "session.audio.output.speed"),
        ({"type": "transcription"}, "session.type"),
        ({"model": "gpt-realtime"}, "session.model"),
        ({"tools": [{"type": "function", "name": "f"}]}, "session.tools"),
        ({"instructions": "be terse"}, "session.instructions"),            # no stage of this pipeline takes it
        ({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}, "session.audio.input.turn_detection"),
        ({"audio": {"output": {"voice": "alloy"}}, "output_modalities": ["video"]}, "session.output_modalities.0"),
    ]:
        with pytest.raises(ProtocolError) as info:
            apply_update(config, bad, caps(), event_id="u1")
        assert info.value.param == param, (bad, info.value.message)
        assert info.value.event_id == "u1"
    text_only = caps(outputs=frozenset({"text"}))
    with pytest.raises(ProtocolError, match="no audio output"):
        apply_update(SessionConfig.default(text_only), {"output_modalities": ["audio"]}, text_only)
    assert apply_update(config, {"audio": {"input": {"turn_detection": None}}}, caps()).turn_detection is None


def test_session_view_is_the_ga_session_object() -> None:
    view = SessionConfig.default(caps()).view(session_id="sess_1", model="omni-toy", expires_at=5)
    assert view["type"] == "realtime" and view["id"] == "sess_1" and view["output_modalities"] == ["audio"]
    assert view["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert view["audio"]["input"]["turn_detection"] is None


def test_a_text_turn_from_item_to_response_and_back_to_idle() -> None:
    session = RealtimeSession.new(caps(), tenant="t")
    effects = handle(session, user_text())
    assert isinstance(effects[0], Save)
    added, done = sent(effects)
    assert added["type"] == "conversation.item.added" and done["type"] == "conversation.item.done"
    assert added["item"]["content"] == [{"type": "input_text", "text": "hello there"}] and added["previous_item_id"] is None
    effects = handle(session, {"type": "response.create", "event_id": "r1"})
    start = [e for e in effects if isinstance(e, StartTurn)]
    assert len(start) == 1 and start[0].response.prompt == "hello there" and start[0].response.modalities == ["audio"]
    response = start[0].response
    assert session.state.response is response and session.state.pending == []
    # out of order while it runs: a second response, nothing to cancel under another id
    assert refused(session, {"type": "response.create", "event_id": "r2"}).code == "conversation_already_has_active_response"
    err = refused(session, {"type": "response.cancel", "event_id": "x1", "response_id": "resp_other"})
    assert err.code == "response_cancel_not_active" and err.event_id == "x1"
    assert session.turn_submitted(response.id, "wf-1") == [Save()] and response.wf_id == "wf-1"
    session.turn_ended(response.id, ResponseStatus.COMPLETED, "You said: hello there", 12)
    assert session.state.response is None and session.state.last_response.events == 12
    assistant = session.state.items[-1]
    assert assistant.role == "assistant" and assistant.id == response.item_id and assistant.text.startswith("You said")
    # a new response without new items answers the last user item again
    again = [e for e in handle(session, {"type": "response.create"}) if isinstance(e, StartTurn)][0]
    assert again.response.prompt == "hello there"


def test_cancel_marks_the_response_and_asks_for_the_abort() -> None:
    session = RealtimeSession.new(caps(), tenant="t")
    assert refused(session, {"type": "response.cancel", "event_id": "k0"}).code == "response_cancel_not_active"
    handle(session, user_text())
    response = [e for e in handle(session, {"type": "response.create"}) if isinstance(e, StartTurn)][0].response
    effects = handle(session, {"type": "response.cancel", "event_id": "k1"})
    assert CancelTurn(response) in effects and response.cancelling
    assert refused(session, {"type": "response.cancel", "event_id": "k2"}).code == "response_cancel_not_active"
    session.turn_ended(response.id, ResponseStatus.CANCELLED, "You said", 7)
    assert session.state.items[-1].status == "incomplete"


def test_items_and_responses_that_are_refused() -> None:
    session = RealtimeSession.new(caps(), tenant="t")
    assert refused(session, {"type": "response.create", "event_id": "n1"}).code == "no_input"
    assert refused(session, user_text("   ")).param == "item.content"
    assert refused(session, user_text("x" * 101)).param == "item.content"
    assert refused(session, {"type": "conversation.item.create", "event_id": "a1", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]}}).param == "item.content.0.type"
    assert refused(session, {"type": "conversation.item.create", "item": {
        "type": "message", "role": "assistant", "content": [{"type": "input_text", "text": "hi"}]}}).param == "item.role"
    assert refused(session, {**user_text(), "previous_item_id": "item_nope"}).code == "item_not_found"
    handle(session, user_text(id="item_mine"))
    assert refused(session, user_text(id="item_mine")).param == "item.id"
    for body, param in [({"tools": [{"type": "function"}]}, "response.tools"),
                        ({"output_modalities": ["video"]}, "response.output_modalities.0"),
                        ({"instructions": "shout"}, "response.instructions"),
                        ({"audio": {"output": {"voice": "nobody"}}}, "response.audio.output.voice")]:
        assert refused(session, {"type": "response.create", "response": body}).param == param


def test_the_input_audio_buffer() -> None:
    session = RealtimeSession.new(caps(), tenant="t")
    pcm = b"\x01\x00" * (MIN_COMMIT_BYTES // 2)
    assert handle(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[:100]).decode()}) == []
    err = refused(session, {"type": "input_audio_buffer.commit", "event_id": "m1"})
    assert err.code == "input_audio_buffer_commit_empty" and err.event_id == "m1"
    assert sent(handle(session, {"type": "input_audio_buffer.clear"}), "input_audio_buffer.cleared")
    assert refused(session, {"type": "input_audio_buffer.append", "audio": "not base64!"}).param == "audio"
    assert refused(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}).param == "audio"
    big = base64.b64encode(b"\x00\x00" * 48_001).decode()
    assert refused(session, {"type": "input_audio_buffer.append", "audio": big}).code == "input_audio_buffer_too_large"
    handle(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    effects = handle(session, {"type": "input_audio_buffer.commit"})
    committed = sent(effects, "input_audio_buffer.committed")[0]
    assert committed["item_id"] == session.state.items[-1].id and not session.buffer
    # a text-only pipeline cannot answer audio: refused, and the session stays as it was
    assert refused(session, {"type": "response.create", "event_id": "z"}).param == "input_audio_buffer"


def test_the_state_round_trips_through_json() -> None:
    session = RealtimeSession.new(caps(), tenant="acme")
    handle(session, user_text())
    handle(session, {"type": "response.create"})
    restored = SessionState.model_validate(json.loads(session.state.model_dump_json()))
    assert restored == session.state


def test_turn_events_are_numbered_in_order_and_parse_back() -> None:
    session = RealtimeSession.new(caps(), tenant="t")
    handle(session, user_text())
    response = [e for e in handle(session, {"type": "response.create"}) if isinstance(e, StartTurn)][0].response
    turn = TurnEvents(response)
    events = [*turn.start(), *turn.text_delta("You"), *turn.audio_delta(b"\x00\x01" * 4), *turn.text_delta(" said"),
              *turn.end(ResponseStatus.COMPLETED, usage={"total_tokens": 3})]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.output_item.added", "response.content_part.added",
                     "response.output_audio_transcript.delta", "response.output_audio.delta",
                     "response.output_audio_transcript.delta", "response.output_audio.done",
                     "response.output_audio_transcript.done", "response.content_part.done",
                     "response.output_item.done", "response.done"]
    assert [parse_event_id(e["event_id"]) for e in events] == [(response.id, n) for n in range(len(events))]
    assert events[-1]["response"]["status"] == "completed" and events[-1]["response"]["output"][0]["content"] == [
        {"type": "output_audio", "transcript": "You said"}]
    assert base64.b64decode(events[4]["delta"]) == b"\x00\x01" * 4
    assert parse_event_id("event_abc") is None and parse_event_id(event_id("resp_x", 3)) == ("resp_x", 3)
    text_turn = TurnEvents(response.model_copy(update={"modalities": ["text"]}))
    text_events = [*text_turn.start(), *text_turn.text_delta("hi"), *text_turn.audio_delta(b"\x00\x00"),
                   *text_turn.end(ResponseStatus.CANCELLED)]
    assert [e["type"] for e in text_events][3:5] == ["response.output_text.delta", "response.output_text.done"]
    done = text_events[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}


def audio(n_bytes: int = MIN_COMMIT_BYTES) -> dict:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x00" * (n_bytes // 2)).decode()}


def test_an_audio_turn_streams_into_its_workflow_and_the_response_follows_it() -> None:
    from omniflow.api.realtime.records import AppendInput, EndInput, OpenInput

    session = RealtimeSession.new(caps(audio_input=True), tenant="t")
    effects = handle(session, audio())
    opened = [e for e in effects if isinstance(e, OpenInput)]
    assert opened and isinstance(effects[-1], AppendInput) and session.state.input is opened[0].turn
    opened[0].turn.wf_id = "wf1"                       # what the connection sets once it submitted it
    assert [type(e) for e in handle(session, audio(480))] == [AppendInput]          # no second workflow
    effects = handle(session, {"type": "input_audio_buffer.commit"})
    assert isinstance(effects[0], EndInput) and session.state.input is None
    item = session.state.items[-1]
    assert (item.kind, item.wf_id, sent(effects, "input_audio_buffer.committed")[0]["item_id"]) == \
        ("audio", "wf1", opened[0].turn.item_id)
    start = [e for e in handle(session, {"type": "response.create"}) if isinstance(e, StartTurn)][0]
    assert start.response.wf_id == "wf1"               # the running workflow answers it: no new submit
    heard = sent(session.transcribed(item.id, "hello omniflow", seconds=1.5),
                 "conversation.item.input_audio_transcription.completed")[0]
    assert heard["transcript"] == "hello omniflow" and session.state.items[0].transcript == "hello omniflow"
    assert sent(session.transcribed(item.id, None, error="no audio"),
                "conversation.item.input_audio_transcription.failed")[0]["error"]["message"] == "no audio"


def test_clear_drops_the_open_turn_and_a_commit_over_a_response_interrupts_it() -> None:
    from omniflow.api.realtime.records import DropInput, OpenInput

    session = RealtimeSession.new(caps(audio_input=True), tenant="t")
    turn = [e for e in handle(session, audio()) if isinstance(e, OpenInput)][0].turn
    effects = handle(session, {"type": "input_audio_buffer.clear"})
    assert isinstance(effects[0], DropInput) and effects[0].turn is turn and session.state.input is None
    assert refused(session, {"type": "input_audio_buffer.commit"}).code == "input_audio_buffer_commit_empty"
    [e for e in handle(session, audio()) if isinstance(e, OpenInput)][0].turn.wf_id = "wf1"
    handle(session, {"type": "input_audio_buffer.commit"})
    response = [e for e in handle(session, {"type": "response.create"}) if isinstance(e, StartTurn)][0].response
    [e for e in handle(session, audio()) if isinstance(e, OpenInput)][0].turn.wf_id = "wf2"   # over the answer ...
    effects = handle(session, {"type": "input_audio_buffer.commit"})
    assert isinstance(effects[0], CancelTurn) and effects[0].response.id == response.id   # ... barge-in
    assert handle(session, {"type": "response.create", "event_id": "later"}) == []        # waits for the end
    after = session.turn_ended(response.id, ResponseStatus.CANCELLED, "", 5)
    queued = [e for e in after if isinstance(e, StartTurn)]
    assert queued and (response.wf_id, queued[0].response.wf_id) == ("wf1", "wf2")


def test_an_audio_turn_refuses_instructions_it_was_not_started_with() -> None:
    from omniflow.api.realtime.records import OpenInput

    session = RealtimeSession.new(caps(audio_input=True, knobs=frozenset({"instructions"})), tenant="t")
    [e for e in handle(session, audio()) if isinstance(e, OpenInput)][0].turn.wf_id = "wf1"
    handle(session, {"type": "input_audio_buffer.commit"})
    err = refused(session, {"type": "response.create", "response": {"instructions": "be terse"}})
    assert err.param == "response.instructions" and "session.update before speaking" in err.message


def test_turn_detection_is_checked() -> None:
    session = RealtimeSession.new(caps(audio_input=True), tenant="t")
    for detection, param in [({"type": "server_vad", "silence_duration_ms": -5},
                              "session.audio.input.turn_detection.silence_duration_ms"),
                             ({"type": "server_vad", "threshold": 2}, "session.audio.input.turn_detection.threshold"),
                             ({"type": "semantic_vad"}, "session.audio.input.turn_detection.type")]:
        update = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": detection}}}}
        assert refused(session, update).param == param
    ok = handle(session, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "silence_duration_ms": 300}}}}})
    assert sent(ok, "session.updated")[0]["session"]["audio"]["input"]["turn_detection"] == {
        "type": "server_vad", "silence_duration_ms": 300}
