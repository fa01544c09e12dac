"""Pipeline specs: a validated DAG of stages, loaded from YAML.

A pipeline is static. Per request, `Pipeline.plan(modalities)` picks the final
stages, the stages they need (their ancestors) and the order in which stages
are submitted: at admission the entry stage and every stage fed only by
`chunk` edges from it (pre-submitted, they wait for input); a stage fed by
`full` edges is submitted by the reconciler once all its producers are done.

Input kinds: a pipeline says which stage takes each kind of input it accepts (`inputs:
{text: thinker, audio: asr}`; default: text, at the entry stage). A request's input kind picks
its entry stage, and its plan holds only the stages reachable from there: omni-cpu's text
requests skip the ASR stage, its audio requests start there. The stage that takes audio reads
it as chunks from the pseudo-stage `@input` (`INPUT_SRC`): the edge log
`<wf>:edge:@input:<stage>`, which a client appends to while the workflow runs
(`Store.append_input`).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from omniflow.errors import InvalidRequest, PipelineError
from omniflow.storage.schema import RECORD_FIELD_NAMES
# the YAML schema: re-exported (`from omniflow.pipeline import ShedMode` and the like keep working)
from omniflow.pipeline_spec import (
    EdgeMode,
    EdgeSpec,
    InputKind,
    Modality,
    PipelineSpec,
    RetryPolicy,
    ShedMode,
    SheddingSpec,
    StageSpec,
)

__all__ = ["INPUT_SRC", "STAGE_NAME_PATTERN", "EdgeMode", "EdgeSpec", "InputKind", "Modality", "Pipeline", "PipelineSpec",
           "Plan", "RetryPolicy", "ShedMode", "SheddingSpec", "StageSpec", "build_pipeline", "import_executor",
           "load_pipeline", "parse_queue", "pool_key", "stage_queue"]

STAGE_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
#: How a workflow's fields are laid out in Redis, a part of every pipeline version (its digest):
#: 3 = final text outputs in the record too (`<stage>:text`, record field `ko`), 2 = the stage fields
#: in the record (`Keys.stages`); 1 (no salt) = apart, in `<wf>:stages`.
STORAGE_LAYOUT = 3
INPUT_SRC = "@input"                 # the pseudo-stage whose edge carries a client's streamed input


def stage_queue(stage: str, version: str) -> str:
    """The task queue of `stage` in the pipeline version `version` (`Keys.tasks` takes it): `<stage>@<version>`;
    the stage's own name for a record of no version (written before versions)."""
    return f"{stage}@{version}" if version else stage


@dataclass(frozen=True)
class Plan:
    """What one request needs from the pipeline."""

    finals: tuple[str, ...]
    stages: tuple[str, ...]                    # required stages, topological order
    admit: tuple[str, ...]                     # submitted at admission
    groups: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]  # (after, stages), deferred
    input_kind: str = "text"
    input_stage: str = ""                      # the stage that reads `@input` ('' for text input)

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
    entries: dict[str, str]                    # input kind -> the stage that takes it

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def input_kinds(self) -> list[str]:
        return list(self.entries)

    @property
    def audio_stage(self) -> str | None:
        """The stage that reads a client's audio (`@input`), if the pipeline takes audio."""
        return self.entries.get("audio")

    def sources(self, stage: str) -> tuple[str, ...]:
        """Every stage `stage` may read from, `@input` included for the stage that takes audio."""
        ups = tuple(e.src for e in self.inputs[stage])
        return (*ups, INPUT_SRC) if stage == self.audio_stage else ups

    def reachable(self, start: str) -> set[str]:
        found = {start}
        for stage in self.order:
            if stage in found:
                found.update(e.dst for e in self.outputs[stage])
        return found

    @property
    def stages(self) -> dict[str, StageSpec]:
        return self.spec.stages

    @property
    def version(self) -> str:
        """The content hash of the canonical definition: what a workflow records and finishes on."""
        return self.digest

    def queue(self, stage: str) -> str:
        """The task queue of `stage` in this version of the pipeline (`Keys.tasks`): `<stage>@<digest>`.
        A session waits in it for a worker that serves this very version."""
        return stage_queue(stage, self.digest)

    def pool_key(self, stage: str) -> str:
        """Which worker pool serves `stage`: a hash of its executor and its params. Stages that two
        pipelines (or two versions of one) declare identically share one pool: one executor in one
        process serves them all (docs/architecture.md, "Several pipelines")."""
        return pool_key(self.spec.stages[stage])

    def canonical(self) -> dict[str, Any]:
        """The definition the digest is taken of (what the registry stores)."""
        return self.spec.model_dump(mode="json", by_alias=True)

    @property
    def input_modalities(self) -> list[str]:
        """What `/v1/models` lists: the kinds `inputs:` names a stage for, else `input:` (default text)."""
        return list(self.entries) if self.spec.inputs else list(self.spec.input)

    @property
    def output_modalities(self) -> list[str]:
        return sorted(self.modalities())

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

    def finals_for(self, modalities: Sequence[str] | None, *, within: set[str] | None = None) -> tuple[str, ...]:
        """Final stages for the requested output modalities (all static finals when None), among
        the stages `within` (those an input kind reaches) when given."""
        if modalities is None:
            return tuple(s for s in self.finals if within is None or s in within)
        by_kind = {kind: [s for s in stages if within is None or s in within]
                   for kind, stages in self.modalities().items()}
        by_kind = {kind: stages for kind, stages in by_kind.items() if stages}
        if not modalities:
            raise InvalidRequest("output_modalities must name at least one of: " + ", ".join(by_kind))
        chosen: set[str] = set()
        for kind in modalities:
            if kind not in by_kind:
                raise InvalidRequest(
                    f"output_modalities: {kind!r} is not produced by pipeline {self.name!r}; "
                    f"it can produce {sorted(by_kind)}"
                )
            chosen.update(by_kind[kind])
        return tuple(s for s in self.order if s in chosen)

    def entry_for(self, input_kind: str) -> str:
        """The stage that takes `input_kind`; InvalidRequest when the pipeline takes no such input."""
        stage = self.entries.get(input_kind)
        if stage is None:
            raise InvalidRequest(f"input: pipeline {self.name!r} takes {' or '.join(self.entries)} input, "
                                 f"not {input_kind}")
        return stage

    def plan(self, modalities: Sequence[str] | None = None, *, final_stages: Sequence[str] | None = None,
             input_kind: str | None = None) -> Plan:
        """The plan of a request for `modalities` (or `final_stages`) with input of `input_kind`
        (None: the first kind the pipeline takes)."""
        input_kind = input_kind or next(iter(self.entries))
        start = self.entry_for(input_kind)
        reach = self.reachable(start)
        if final_stages is not None:
            unknown = [s for s in final_stages if s not in self.finals or s not in reach]
            if unknown or not final_stages:
                raise InvalidRequest(
                    f"final_stages {list(final_stages)} must be a non-empty subset of the pipeline's finals "
                    f"{[s for s in self.finals if s in reach]}"
                )
            finals = tuple(s for s in self.order if s in set(final_stages))
        else:
            finals = self.finals_for(modalities, within=reach)
        needed = set(finals)
        for stage in reversed(self.order):
            if stage in needed:
                needed.update(e.src for e in self.inputs[stage] if e.src in reach)
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
        return Plan(finals=finals, stages=stages, admit=tuple(groups[0][1]), groups=deferred, input_kind=input_kind,
                    input_stage=start if input_kind == "audio" else "")

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
    if not spec.stages:
        raise PipelineError(f"{source}: stages: a pipeline needs at least one stage")
    for name in spec.stages:
        if not re.match(STAGE_NAME_PATTERN, name):
            raise PipelineError(f"{source}: stages.{name}: stage names are lower-case letters, digits and '_'")
        if name in RECORD_FIELD_NAMES:
            raise PipelineError(f"{source}: stages.{name}: {name!r} is reserved (a field of every workflow's "
                                f"record, which holds its stages' fields too); reserved: {', '.join(sorted(RECORD_FIELD_NAMES))}")
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
    entries: dict[str, str] = {str(k): v for k, v in spec.inputs.items()} if spec.inputs else {"text": entry}
    if not entries:
        raise PipelineError(f"{source}: inputs: name the stage that takes text or audio input")
    for kind, stage in entries.items():
        if stage not in spec.stages:
            raise PipelineError(f"{source}: inputs.{kind}: unknown stage {stage!r} (stages: {sorted(spec.stages)})")
    if spec.inputs is None and inputs[entry]:
        raise PipelineError(f"{source}: entry: the entry stage {entry!r} cannot have inputs")
    starts: dict[str, set[str]] = {}
    for kind, stage in entries.items():
        starts[kind] = {stage}
        for name in order:
            if name in starts[kind]:
                starts[kind].update(e.dst for e in outputs[name])
    reachable = set().union(*starts.values())
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
    for name, stage_doc in dumped["stages"].items():
        if spec.stages[name].reserved_slots is None:
            stage_doc.pop("reserved_slots")     # (nor does the default headroom change it)
    # the storage layout is part of a version: a worker of an omniflow that kept the stage fields apart
    # from the record (layout 1) never reads the queues of a workflow whose record holds them (2), which
    # it would take for stale and drop; each finishes the workflows it started (docs/operations.md)
    digest = _hash({**dumped, "storage_layout": STORAGE_LAYOUT})
    return Pipeline(
        spec=spec,
        digest=digest,
        order=tuple(order),
        entry=entry,
        inputs={s: tuple(v) for s, v in inputs.items()},
        outputs={s: tuple(v) for s, v in outputs.items()},
        entries=entries,
    )


def _hash(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def pool_key(spec: StageSpec) -> str:
    """A stage's pool key: the hash of its executor and its params (see `Pipeline.pool_key`)."""
    return _hash({"executor": spec.executor, "params": spec.params})


def parse_queue(queue: str) -> tuple[str, str]:
    """`<stage>@<digest>` -> (stage, digest); `PipelineError` when it is not one."""
    stage, sep, digest = queue.partition("@")
    if not sep or not re.match(STAGE_NAME_PATTERN, stage) or not re.fullmatch(r"[0-9a-f]{16}", digest):
        raise PipelineError(f"{queue!r} is not a task queue ('<stage>@<pipeline version>')")
    return stage, digest


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
