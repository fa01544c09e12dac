"""Which pipeline serves a request: its `model`, checked against what the route needs.

`model` names one of the deployment's pipelines (`deps.pipeline_for`: a name, `name@version`, or
None for the default; an unknown one is a 404 naming the known ones); a route also asks what it
needs the pipeline to take and make.
"""
from __future__ import annotations

from omniflow.api import deps
from omniflow.api.deps import ApiState
from omniflow.api.errors import ApiError
from omniflow.pipeline import Pipeline


async def pipeline_for(state: ApiState, model: str | None, *, takes: str | None = None, makes: str | None = None,
                       param: str = "model") -> Pipeline:
    """The pipeline `model` names (None: the one served), if it takes input kind `takes` and makes
    output kind `makes`: else a 404 (unknown model) or a 400 naming what it cannot do."""
    pipeline = await deps.pipeline_for(state, model, param=param)
    if takes is not None and takes not in pipeline.entries:
        raise ApiError(400, "unsupported_value", f"model {pipeline.name!r} takes no {takes} input (it takes "
                                                 f"{', '.join(pipeline.entries)})", param=param)
    if makes is not None and makes not in pipeline.modalities():
        raise ApiError(400, "unsupported_value", f"model {pipeline.name!r} makes no {makes} (its outputs: "
                                                 f"{sorted(pipeline.modalities())})", param=param)
    return pipeline
