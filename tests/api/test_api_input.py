"""`POST /v1/workflows/{id}/input`: audio streamed over HTTP into a workflow submitted with
`input.audio` (the toy pipeline that takes audio), per tenant, ended with `final=true`."""
from __future__ import annotations

import numpy as np
import pytest

from apiserver import KEYS, api_factory, auth_settings  # noqa: F401 - fixture
from conftest import toy_audio_spec

pytestmark = pytest.mark.timeout(60)
RATE = 16000

async def test_http_input_route_streams_audio_into_a_workflow(api_factory) -> None:
    async with api_factory(toy_audio_spec(), **auth_settings()) as (_engine, server), \
            server.client(KEYS["alice"]) as http, server.client(KEYS["bob"]) as other:
        r = await http.post("/v1/workflows", json={"input": {"audio": {"sample_rate": RATE}}})
        wf = r.json()["id"]
        half = (np.ones(RATE // 2, dtype="<i2") * 50).tobytes()
        assert (await http.post(f"/v1/workflows/{wf}/input", content=half)).json() == {"id": wf, "seq": 1,
                                                                                      "final": False}
        assert (await other.post(f"/v1/workflows/{wf}/input", content=half)).status_code == 404   # not bob's
        assert (await http.post(f"/v1/workflows/{wf}/input", content=b"\x00")).status_code == 422
        assert (await http.post(f"/v1/workflows/{wf}/input", params={"final": "true"}, content=half)).json()["seq"] == 3
        again = await http.post(f"/v1/workflows/{wf}/input", content=half)
        assert again.status_code == 409 and again.json()["error"]["code"] == "input_closed"
        doc = (await http.get(f"/v1/workflows/{wf}", params={"wait": 20})).json()
        assert doc["state"] == "completed" and doc["outputs"]["thinker"]["text"].startswith("You said: hello omniflow")
        text = (await http.post("/v1/workflows", json={"input": {"text": "hi"}})).json()["id"]
        refused = await http.post(f"/v1/workflows/{text}/input", content=half)
        assert refused.status_code == 422 and "no streamed input" in refused.json()["error"]["message"]


async def test_an_audio_workflow_is_not_retried_without_its_audio(api_factory) -> None:
    async with api_factory(toy_audio_spec()) as (_engine, server), server.client() as http:
        wf = (await http.post("/v1/workflows", json={"input": {"audio": {"sample_rate": RATE}}})).json()["id"]
        await http.post(f"/v1/workflows/{wf}/abort")
        r = await http.post(f"/v1/workflows/{wf}/retry")
        assert r.status_code == 422 and "submit it again with its audio" in r.json()["error"]["message"]
