"""The pipelines one process serves: several per deployment (`--pipeline a.yaml --pipeline b.yaml`).

A `Catalog` holds them in the order given (the first is the default: what a request that names
none gets), finds one by name (what a request's `pipeline` or OpenAI `model` says) or by version
(the content hash a workflow records), and groups their stages into worker pools: stages declared
identically (same executor, same params: `Pipeline.pool_key`) are one pool, whatever pipeline or
version declares them.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omniflow.errors import PipelineError, UnknownPipeline
from omniflow.pipeline import Pipeline, load_pipeline


@dataclass
class Catalog:
    """Pipelines by name (the first is the default) and every version known, by digest."""

    pipelines: dict[str, Pipeline] = field(default_factory=dict)
    versions: dict[str, Pipeline] = field(default_factory=dict)

    @classmethod
    def of(cls, pipelines: Pipeline | Iterable[Pipeline]) -> Catalog:
        """A catalog of these pipelines (two with one name: `PipelineError`)."""
        cat = cls()
        for pipe in [pipelines] if isinstance(pipelines, Pipeline) else pipelines:
            if pipe.name in cat.pipelines and cat.pipelines[pipe.name].digest != pipe.digest:
                raise PipelineError(f"two pipelines are named {pipe.name!r}; a deployment serves one version "
                                    "of a name per process (give the other a new name)")
            cat.pipelines.setdefault(pipe.name, pipe)
            cat.versions[pipe.digest] = pipe
        if not cat.pipelines:
            raise PipelineError("no pipeline given")
        return cat

    @classmethod
    def load(cls, paths: Sequence[str | Path]) -> Catalog:
        return cls.of([load_pipeline(p) for p in paths])

    @property
    def default(self) -> Pipeline:
        return next(iter(self.pipelines.values()))

    def __iter__(self) -> Iterator[Pipeline]:
        return iter(self.pipelines.values())

    def __len__(self) -> int:
        return len(self.pipelines)

    @property
    def names(self) -> list[str]:
        return list(self.pipelines)

    def get(self, name: str | None) -> Pipeline:
        """The pipeline called `name` (None or '': the default); `UnknownPipeline` naming the known ones."""
        if not name:
            return self.default
        pipe = self.pipelines.get(name)
        if pipe is None:
            raise UnknownPipeline(f"unknown pipeline {name!r}; this deployment serves {self.names}",
                                  known=self.names)
        return pipe

    def version(self, digest: str) -> Pipeline | None:
        return self.versions.get(digest)

    def find(self, ref: str | None) -> Pipeline | None:
        """`name` or `name@version` -> the pipeline, when this catalog knows it (None: ask the registry)."""
        if not ref:
            return self.default
        name, _, version = ref.partition("@")
        if version:
            pipe = self.versions.get(version)
            return pipe if pipe is not None and pipe.name == name else None
        return self.pipelines.get(name)

    def resolve(self, ref: str | None, *, param: str = "model") -> Pipeline:
        """Like `find`, or `UnknownPipeline` naming the pipelines known."""
        pipe = self.find(ref)
        if pipe is None:
            name, _, version = (ref or "").partition("@")
            what = f"pipeline {name!r} version {version}" if version else f"pipeline {name!r}"
            raise UnknownPipeline(f"unknown {what}; this deployment serves {self.names}", known=self.names,
                                  param=param)
        return pipe

    def add(self, pipe: Pipeline, *, serve_name: bool = True) -> None:
        """Learn a version (registered by another process); it becomes the one its name picks when
        `serve_name` and this catalog had no pipeline of that name."""
        self.versions.setdefault(pipe.digest, pipe)
        if serve_name:
            self.pipelines.setdefault(pipe.name, pipe)

    def stage_names(self) -> set[str]:
        return {st for pipe in self.versions.values() for st in pipe.stages}

    def routes(self, stages: str | Sequence[str]) -> list[tuple[Pipeline, str]]:
        """The (pipeline, stage) pairs a worker serves for `--stage`: `all`, or names, each served in
        every pipeline that has a stage of that name. A name no pipeline has: `PipelineError`."""
        names = [x.strip() for x in (stages.split(",") if isinstance(stages, str) else stages) if x.strip()]
        every = {f"{p.name}: {list(p.order)}" for p in self}
        if not names:
            raise PipelineError(f"no stage given; the pipelines have {'; '.join(sorted(every))}")
        if len(set(names)) != len(names):
            raise PipelineError(f"stage listed twice in {','.join(names)!r}")
        if names == ["all"]:
            return [(p, st) for p in self for st in p.order]
        for name in names:
            if not any(name in p.stages for p in self):
                raise PipelineError(f"unknown stage {name!r}; the pipelines have {'; '.join(sorted(every))}")
        return [(p, st) for p in self for st in p.order if st in names]
