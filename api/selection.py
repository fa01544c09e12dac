"""Which pipeline serves a request: its `model`, checked against what the route needs.

One function, so that serving several pipelines per deployment changes one place: today a
deployment serves one pipeline (`ApiState.pipeline`), and `model` must name it.
"""
from __future__ import annotations

from omniflow.api.deps import ApiState
from omniflow.api.errors import ApiError
from omniflow.pipeline import Pipeline


def pipeline_for(state: ApiState, model: str | None, *, takes: str | None = None, makes: str | None = None,
                 param: str = "model") -> Pipeline:
    """The pipeline `model` names (None: the one served), if it takes input kind `takes` and makes
    output kind `makes`: else a 404 (unknown model) or a 400 naming what it cannot do."""
    pipeline = state.pipeline
    if model is not None and model != pipeline.name:
        raise ApiError(404, "model_not_found", f"model {model!r} does not exist; this server serves "
                                               f"{pipeline.name!r} (GET /v1/models)", param=param)
    if takes is not None and takes not in pipeline.entries:
        raise ApiError(400, "unsupported_value", f"model {pipeline.name!r} takes no {takes} input (it takes "
                                                 f"{', '.join(pipeline.entries)})", param=param)
    if makes is not None and makes not in pipeline.modalities():
        raise ApiError(400, "unsupported_value", f"model {pipeline.name!r} makes no {makes} (its outputs: "
                                                 f"{sorted(pipeline.modalities())})", param=param)
    return pipeline
