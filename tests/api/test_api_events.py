"""SSE events: the whole story of a workflow, resumable with Last-Event-ID."""
from __future__ import annotations

import json

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec
from omniflow.storage.schema import event_position


async def read_sse(response) -> list[dict]:
    """Parse an SSE body into [{'id', 'event', 'data'}] until the terminal event."""
    events, current = [], {}
    async for line in response.aiter_lines():
        if line == "":
            if "data" in current:
                events.append(current)
                if current.get("event") == "terminal":
                    break
            current = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(": ")
            current[field] = json.loads(value) if field == "data" else value
    return events


async def test_sse_streams_transitions_text_audio_and_terminal(api_factory):
    async with api_factory(toy_spec(thinker={"token_delay_s": 0.02})) as (_engine, server), server.client() as http:
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "stream it"}})).json()["id"]
        async with http.stream("GET", f"/v1/workflows/{wf_id}/events") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = await read_sse(r)
        kinds = [e["event"] for e in events]
        assert kinds[0] == "state" and kinds[-1] == "terminal" and events[-1]["data"]["state"] == "completed"
        assert {"stage", "text", "audio"} <= set(kinds)
        text = "".join(e["data"]["delta"] for e in events if e["event"] == "text")
        doc = (await http.get(f"/v1/workflows/{wf_id}")).json()
        assert text == doc["outputs"]["thinker"]["text"]
        assert all(e["id"] == e["data"]["id"] for e in events)

        # resume after any event (an entry holds the events of one script call: `<entry id>.<k>` is the
        # k-th after its first, so a cut may fall inside an entry): exactly the rest, same ids
        assert any("." in e["id"] for e in events)
        for i, cut in enumerate(e["id"] for e in events[:-1]):
            async with http.stream("GET", f"/v1/workflows/{wf_id}/events", headers={"Last-Event-ID": cut}) as r:
                rest = await read_sse(r)
            assert [e["id"] for e in rest] == [e["id"] for e in events[i + 1:]], cut


async def test_sse_resumes_mid_flight_without_gaps(api_factory):
    async with api_factory(toy_spec(thinker={"token_delay_s": 0.05})) as (_engine, server), server.client() as http:
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "drop and resume"}})).json()["id"]
        seen = []
        async with http.stream("GET", f"/v1/workflows/{wf_id}/events") as r:
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    seen.append(line[4:])
                if len(seen) == 4:
                    break            # the client goes away mid-stream
        async with http.stream("GET", f"/v1/workflows/{wf_id}/events", headers={"Last-Event-ID": seen[-1]}) as r:
            rest = await read_sse(r)
        assert rest[-1]["event"] == "terminal"
        async with http.stream("GET", f"/v1/workflows/{wf_id}/events") as r:
            full = await read_sse(r)
        assert seen + [e["id"] for e in rest] == [e["id"] for e in full]


async def test_sse_errors(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        assert (await http.get("/v1/workflows/unknown/events")).status_code == 404
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "x"}})).json()["id"]
        r = await http.get(f"/v1/workflows/{wf_id}/events", headers={"Last-Event-ID": "garbage"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"


async def test_sse_resumed_at_or_past_the_terminal_ends_at_once_with_204(api_factory):
    """What a browser EventSource does after the server closed a finished stream: reconnect with
    the last id. 204 tells it to stop (it would otherwise get keep-alives forever)."""
    async with api_factory() as (_engine, server), server.client() as http:
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "finish"}})).json()["id"]
        async with http.stream("GET", f"/v1/workflows/{wf_id}/events") as r:
            events = await read_sse(r)
        terminal = events[-1]["id"]         # an event id: its entry's stream id, and `.k` for its k-th event after the first
        ms, seq, _k = event_position(terminal)
        for cursor in (terminal, f"{ms}-{seq + 5}", f"{ms + 60_000}-0"):
            r = await http.get(f"/v1/workflows/{wf_id}/events", headers={"Last-Event-ID": cursor}, timeout=5)
            assert r.status_code == 204 and r.content == b"", cursor
        r = await http.get(f"/v1/workflows/{wf_id}/events", params={"after": events[-2]["id"]}, timeout=5)
        assert r.status_code == 200 and '"terminal"' in r.text and r.text.count("event: ") == 1
