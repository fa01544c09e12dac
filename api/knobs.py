"""What an OpenAI request may tune, mapped to the stage params that do it.

| knob (request field)                 | stage param     | e.g.                                     |
|--------------------------------------|-----------------|------------------------------------------|
| `speed` (speech, realtime)           | `speed`         | the Talker's length scale, the toy's pace |
| `instructions` (realtime)            | `system_prompt` | the Thinker's system turn                |
| `max_output_tokens` (realtime)       | `max_tokens`    | the Thinker's budget                     |

A knob is honoured only where a stage of the pipeline declares the param it maps to (in its
YAML `params`, with the default it has when no request sets it): the request's value overrides
it for that workflow (`stage_params`). A request that sets a knob no stage of its pipeline
declares is refused with a 4xx naming the knob (`KnobUnsupported`), never accepted and ignored.
A knob left at its neutral value (None) asks nothing.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniflow.errors import InvalidRequest
from omniflow.pipeline import Pipeline

KNOB_PARAMS: dict[str, str] = {"speed": "speed", "instructions": "system_prompt", "max_output_tokens": "max_tokens"}


class KnobUnsupported(InvalidRequest):
    """Raised when a request sets a knob that no stage of its pipeline declares (HTTP 400)."""

    code = "unsupported_parameter"
    http_status = 400

    def __init__(self, knob: str, pipeline: str, *, param: str | None = None) -> None:
        super().__init__(f"{param or knob}: model {pipeline!r} cannot honour it (no stage of the pipeline declares "
                         f"the param {KNOB_PARAMS[knob]!r}); leave it unset")
        self.knob, self.param = knob, param or knob


def stages_for(pipeline: Pipeline, knob: str) -> list[str]:
    """The stages that declare the param `knob` maps to."""
    param = KNOB_PARAMS[knob]
    return [st for st in pipeline.order if param in pipeline.stages[st].params]


def supports(pipeline: Pipeline, knob: str) -> bool:
    return bool(stages_for(pipeline, knob))


def stage_params(pipeline: Pipeline, knobs: Mapping[str, Any], *,
                 params: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """`stage_params` overrides for the knobs that are set (not None); `KnobUnsupported` for one no
    stage declares (`params` names the request field of each knob in the error, e.g.
    `session.audio.output.speed`)."""
    out: dict[str, dict[str, Any]] = {}
    for knob, value in knobs.items():
        if value is None:
            continue
        stages = stages_for(pipeline, knob)
        if not stages:
            raise KnobUnsupported(knob, pipeline.name, param=(params or {}).get(knob))
        for stage in stages:
            out.setdefault(stage, {})[KNOB_PARAMS[knob]] = value
    return out
