"""Pipeline specs: a validated DAG of stages, loaded from YAML.

A pipeline is static. Per request, `Pipeline.plan(modalities)` picks the final
stages, the stages they need (their ancestors) and the order in which stages
are submitted: at admission the entry stage and every stage fed only by
`chunk` edges from it (pre-submitted, they wait for input); a stage fed by
`full` edges is submitted by the reconciler once all its producers are done.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from omniflow.errors import InvalidRequest, PipelineError

STAGE_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"


class EdgeMode(str, Enum):
    CHUNK = "chunk"
    FULL = "full"


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(3, ge=1, le=100)
    backoff_s: float = Field(0.1, ge=0)
    backoff_max_s: float = Field(5.0, ge=0)
    jitter: float = Field(0.2, ge=0, le=1)
    attempt_timeout_s: float = Field(600.0, gt=0)
    input_timeout_s: float = Field(120.0, gt=0)


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    executor: str = Field(..., description="import path 'module:Class' of the stage executor")
    final_output: Literal["text", "audio"] | None = None
    replicas: int = Field(1, ge=1, le=256)
    max_sessions: int = Field(8, ge=1, le=4096)
    prefetch: int | None = Field(
        None, ge=0, le=4096,
        description="sessions claimed ahead of a free slot, so a freed slot starts the next one with no "
                    "round trip (default: max_sessions / 4, at least 1)")
    params: dict[str, Any] = Field(default_factory=dict)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)

    @field_validator("executor")
    @classmethod
    def _executor_path(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"must look like 'package.module:ClassName', got {value!r}")
        return value


class EdgeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    src: str = Field(..., alias="from")
    dst: str = Field(..., alias="to")
    mode: EdgeMode = EdgeMode.CHUNK


class ShedMode(str, Enum):
    """What a submit does when the stage queues predict its request would miss its deadline."""

    OFF = "off"             # accept it (it may time out)
    DEGRADE = "degrade"     # run it with fewer outputs (`degrade_to`, e.g. text only), flagged; refuse if even that is late
    REFUSE = "refuse"       # refuse it at submit (503 `deadline_unmeetable`, Retry-After)


Modality = Literal["text", "audio"]


def _text_only() -> list[Modality]:
    return ["text"]


class SheddingSpec(BaseModel):
    """Deadline-aware shedding (docs/operations.md, "Deadline-aware shedding")."""

    model_config = ConfigDict(extra="forbid")

    on_late: ShedMode = ShedMode.OFF
    degrade_to: list[Modality] = Field(
        default_factory=_text_only, min_length=1,
        description="the output modalities a degraded request keeps (a subset of the pipeline's)")
    margin: float = Field(
        1.0, gt=0, le=10, description="late: the predicted time to the outputs is over deadline_s x margin")

    @field_validator("degrade_to")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("degrade_to has duplicates")
        return value


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    entry: str | None = Field(None, description="the entry stage (default: the first listed stage without inputs)")
    stages: dict[str, StageSpec]
    edges: list[EdgeSpec] = Field(default_factory=list)
    shedding: SheddingSpec = Field(default_factory=SheddingSpec)


@dataclass(frozen=True)
class Plan:
    """What one request needs from the pipeline."""

    finals: tuple[str, ...]
    stages: tuple[str, ...]                    # required stages, topological order
    admit: tuple[str, ...]                     # submitted at admission
    groups: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]  # (after, stages), deferred

    def record_groups(self) -> str:
        return json.dumps([{"after": list(a), "stages": list(s)} for a, s in self.groups])


@dataclass(frozen=True)
class Pipeline:
    """A validated pipeline (see `load_pipeline`)."""

    spec: PipelineSpec
    digest: str
    order: tuple[str, ...]
    entry: str
    inputs: dict[str, tuple[EdgeSpec, ...]]
    outputs: dict[str, tuple[EdgeSpec, ...]]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stages(self) -> dict[str, StageSpec]:
        return self.spec.stages

    @property
    def finals(self) -> tuple[str, ...]:
        return tuple(s for s in self.order if self.spec.stages[s].final_output)

    def modalities(self) -> dict[str, list[str]]:
        by_kind: dict[str, list[str]] = {}
        for stage in self.finals:
            kind = self.spec.stages[stage].final_output
            assert kind is not None
            by_kind.setdefault(kind, []).append(stage)
        return by_kind

    def finals_for(self, modalities: Sequence[str] | None) -> tuple[str, ...]:
        """Final stages for the requested output modalities (all static finals when None)."""
        if modalities is None:
            return self.finals
        if not modalities:
            raise InvalidRequest("output_modalities must name at least one of: " + ", ".join(self.modalities()))
        by_kind = self.modalities()
        chosen: set[str] = set()
        for kind in modalities:
            if kind not in by_kind:
                raise InvalidRequest(
                    f"output_modalities: {kind!r} is not produced by pipeline {self.name!r}; "
                    f"it can produce {sorted(by_kind)}"
                )
            chosen.update(by_kind[kind])
        return tuple(s for s in self.order if s in chosen)

    def plan(self, modalities: Sequence[str] | None = None, *, final_stages: Sequence[str] | None = None) -> Plan:
        if final_stages is not None:
            unknown = [s for s in final_stages if s not in self.finals]
            if unknown or not final_stages:
                raise InvalidRequest(
                    f"final_stages {list(final_stages)} must be a non-empty subset of the pipeline's finals "
                    f"{list(self.finals)}"
                )
            finals = tuple(s for s in self.order if s in set(final_stages))
        else:
            finals = self.finals_for(modalities)
        needed = set(finals)
        for stage in reversed(self.order):
            if stage in needed:
                needed.update(e.src for e in self.inputs[stage])
        stages = tuple(s for s in self.order if s in needed)
        group_of: dict[str, int] = {}
        groups: list[tuple[set[str], list[str]]] = [(set(), [])]
        for stage in stages:
            ins = [e for e in self.inputs[stage] if e.src in needed]
            if not ins:
                group_of[stage] = 0
            elif ins[0].mode is EdgeMode.CHUNK:
                group_of[stage] = group_of[ins[0].src]   # same group as its chunk producers (validated)
            else:
                groups.append(({e.src for e in ins}, []))
                group_of[stage] = len(groups) - 1
            groups[group_of[stage]][1].append(stage)
        deferred = tuple((tuple(sorted(after)), tuple(members)) for after, members in groups[1:])
        return Plan(finals=finals, stages=stages, admit=tuple(groups[0][1]), groups=deferred)

    def downstream(self, stage: str, required: Iterable[str]) -> list[str]:
        req = set(required)
        return [e.dst for e in self.outputs[stage] if e.dst in req]

    def descendants(self, stage: str, required: Iterable[str]) -> list[str]:
        """Every stage downstream of `stage` among `required`, in topological order."""
        req, found = set(required), {stage}
        for name in self.order:
            if name != stage and any(e.src in found for e in self.inputs[name]) and name in req:
                found.add(name)
        return [name for name in self.order if name in found and name != stage]

    def upstream(self, stage: str, required: Iterable[str]) -> list[EdgeSpec]:
        req = set(required)
        return [e for e in self.inputs[stage] if e.src in req]


def load_pipeline(path: str | Path) -> Pipeline:
    """Load and validate a pipeline YAML; raise `PipelineError` naming the field and the reason."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise PipelineError(f"pipeline file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: not valid YAML: {exc}") from exc
    return build_pipeline(raw, source=str(path))


def build_pipeline(raw: Any, *, source: str = "<pipeline>") -> Pipeline:
    if not isinstance(raw, dict):
        raise PipelineError(f"{source}: the top level must be a mapping with 'name', 'stages' and 'edges'")
    try:
        spec = PipelineSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise PipelineError(f"{source}: {loc}: {first['msg']}") from exc
    return _validate(spec, source)


def _validate(spec: PipelineSpec, source: str) -> Pipeline:
    import re

    if not spec.stages:
        raise PipelineError(f"{source}: stages: a pipeline needs at least one stage")
    for name in spec.stages:
        if not re.match(STAGE_NAME_PATTERN, name):
            raise PipelineError(f"{source}: stages.{name}: stage names are lower-case letters, digits and '_'")
    inputs: dict[str, list[EdgeSpec]] = {s: [] for s in spec.stages}
    outputs: dict[str, list[EdgeSpec]] = {s: [] for s in spec.stages}
    seen: dict[tuple[str, str], EdgeMode] = {}
    for i, edge in enumerate(spec.edges):
        for end, name in (("from", edge.src), ("to", edge.dst)):
            if name not in spec.stages:
                raise PipelineError(f"{source}: edges[{i}].{end}: unknown stage {name!r} (stages: {sorted(spec.stages)})")
        if edge.src == edge.dst:
            raise PipelineError(f"{source}: edges[{i}]: a stage cannot feed itself ({edge.src!r})")
        pair = (edge.src, edge.dst)
        if pair in seen:
            what = "both chunk and full" if seen[pair] is not edge.mode else "declared twice"
            raise PipelineError(f"{source}: edges[{i}]: edge {edge.src} -> {edge.dst} is {what}; an edge has one mode")
        seen[pair] = edge.mode
        inputs[edge.dst].append(edge)
        outputs[edge.src].append(edge)
    order = _toposort(spec, inputs, outputs, source)
    # default entry: the first listed stage that has no inputs (others without inputs are unreachable)
    entry = spec.entry or next((s for s in spec.stages if not inputs[s]), next(iter(spec.stages)))
    if entry not in spec.stages:
        raise PipelineError(f"{source}: entry: unknown stage {entry!r}")
    if inputs[entry]:
        raise PipelineError(f"{source}: entry: the entry stage {entry!r} cannot have inputs")
    reachable = {entry}
    for stage in order:
        if stage in reachable:
            reachable.update(e.dst for e in outputs[stage])
    finals = [s for s in order if spec.stages[s].final_output]
    if not finals:
        raise PipelineError(f"{source}: stages: no stage has final_output (text or audio)")
    for stage in order:
        if stage not in reachable:
            what = "final stage" if spec.stages[stage].final_output else "stage"
            raise PipelineError(f"{source}: stages.{stage}: {what} is unreachable from entry stage {entry!r}")
    for stage in order:
        modes = {e.mode for e in inputs[stage]}
        if len(modes) > 1:
            raise PipelineError(
                f"{source}: stages.{stage}: inputs mix chunk and full edges; split the stage or use one mode"
            )
    shed = spec.shedding
    if shed.on_late is ShedMode.DEGRADE:
        kinds = {spec.stages[s].final_output for s in finals}
        extra = sorted(set(shed.degrade_to) - kinds)
        if extra:
            raise PipelineError(f"{source}: shedding.degrade_to: {extra} is not produced by this pipeline "
                                f"(it produces {sorted(k for k in kinds if k)})")
        if set(shed.degrade_to) == kinds:
            raise PipelineError(f"{source}: shedding.degrade_to: {shed.degrade_to} is every output of this pipeline; "
                                "degrading must drop one (or use on_late: refuse)")
    dumped = spec.model_dump(mode="json", by_alias=True)
    if shed == SheddingSpec():
        dumped.pop("shedding")      # the digest of a pipeline without shedding is what it always was
    digest = hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]
    return Pipeline(
        spec=spec,
        digest=digest,
        order=tuple(order),
        entry=entry,
        inputs={s: tuple(v) for s, v in inputs.items()},
        outputs={s: tuple(v) for s, v in outputs.items()},
    )


def _toposort(spec: PipelineSpec, inputs: dict[str, list[EdgeSpec]], outputs: dict[str, list[EdgeSpec]], source: str) -> list[str]:
    indeg = {s: len(inputs[s]) for s in spec.stages}
    ready = [s for s in spec.stages if indeg[s] == 0]
    order: list[str] = []
    while ready:
        stage = ready.pop(0)
        order.append(stage)
        for edge in outputs[stage]:
            indeg[edge.dst] -= 1
            if indeg[edge.dst] == 0:
                ready.append(edge.dst)
    if len(order) != len(spec.stages):
        cyclic = sorted(s for s in spec.stages if s not in order)
        raise PipelineError(f"{source}: edges: cycle through stages {cyclic}")
    return order


def import_executor(path: str) -> type:
    """Import 'module:Class'; a clear `PipelineError` when it is not there."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineError(f"executor {path!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)  # type: ignore[no-any-return]
    except AttributeError as exc:
        raise PipelineError(f"executor {path!r}: module {module_name!r} has no {attr!r}") from exc
