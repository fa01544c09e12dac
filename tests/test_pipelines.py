"""Several pipelines in one deployment (docs/architecture.md, "Several pipelines"): the pool-key rule,
pipeline versions, one worker process serving the identical stage of two pipelines, a workflow
finishing on the version it started with (it waits for a worker of that version, or fails at its
deadline naming it), and pipelines added to a running deployment through the registry."""
from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Engine, toy_spec
from helpers import cli_env, omniflow, request, run_to_end
from workers_fixtures import RecordingTalker

from omniflow.catalog import Catalog
from omniflow.config import Settings
from omniflow.engine.worker import Worker
from omniflow.engine.worker.pool import unique_cores
from omniflow.errors import PipelineError, UnknownPipeline
from omniflow.pipeline import Pipeline, build_pipeline, load_pipeline, parse_queue
from omniflow.storage import registry

PIPELINES = Path(__file__).resolve().parents[1] / "deploy" / "pipelines"
TALKER = "workers_fixtures:RecordingTalker"


def omni_spec(name: str = "omni-t", **thinker: Any) -> dict[str, Any]:
    """The toy omni pipeline (text -> thinker -> talker -> code2wav), its talker recording who ran it."""
    spec = toy_spec(thinker=thinker)
    spec["name"] = name
    spec["stages"]["talker"]["executor"] = TALKER
    return spec


def tts_spec(name: str = "tts-t") -> dict[str, Any]:
    """Text -> talker -> code2wav, the two stages declared exactly as in `omni_spec`."""
    omni = omni_spec()
    return {"name": name, "stages": {"talker": copy.deepcopy(omni["stages"]["talker"]),
                                     "code2wav": copy.deepcopy(omni["stages"]["code2wav"])},
            "edges": [{"from": "talker", "to": "code2wav", "mode": "chunk"}]}


# ---------------------------------------------------------------- the rules, without Redis
def test_identical_stages_have_one_pool_key_whatever_else_differs() -> None:
    omni, tts = build_pipeline(omni_spec()), build_pipeline(tts_spec())
    assert omni.pool_key("talker") == tts.pool_key("talker")
    assert omni.pool_key("code2wav") == tts.pool_key("code2wav")
    assert omni.pool_key("thinker") != omni.pool_key("talker")
    # scheduling and retry settings are not part of the key; executor params are
    other = tts_spec()
    other["stages"]["talker"]["max_sessions"] = 3
    other["stages"]["talker"]["retry"] = {"max_attempts": 7}
    assert build_pipeline(other).pool_key("talker") == omni.pool_key("talker")
    other["stages"]["talker"]["params"]["chunk_delay_s"] = 0.5
    assert build_pipeline(other).pool_key("talker") != omni.pool_key("talker")
    # the shipped CPU pipelines declare their voice identically: one Piper serves both
    cpu, speech = load_pipeline(PIPELINES / "omni-cpu.yaml"), load_pipeline(PIPELINES / "tts-cpu.yaml")
    assert cpu.pool_key("talker") == speech.pool_key("talker")
    assert cpu.pool_key("code2wav") == speech.pool_key("code2wav")


def test_a_version_is_the_hash_of_the_canonical_definition() -> None:
    one, again = build_pipeline(omni_spec()), build_pipeline(omni_spec())
    assert one.digest == again.digest and len(one.digest) == 16
    assert build_pipeline(omni_spec(max_words=3)).digest != one.digest
    # what the registry stores rebuilds the same version (a reconciler finds it from the digest)
    assert build_pipeline(json.loads(json.dumps(one.canonical()))).digest == one.digest
    assert parse_queue(one.queue("talker")) == ("talker", one.digest)
    with pytest.raises(PipelineError, match="not a task queue"):
        parse_queue("talker")
    assert one.input_modalities == ["text"] and one.output_modalities == ["audio", "text"]


def test_a_catalog_routes_stages_and_names_what_it_serves() -> None:
    omni, tts = build_pipeline(omni_spec()), build_pipeline(tts_spec())
    cat = Catalog.of([omni, tts])
    assert cat.default is omni and cat.get("tts-t") is tts and cat.get(None) is omni
    assert cat.routes("talker") == [(omni, "talker"), (tts, "talker")]
    assert len(cat.routes("all")) == 5
    with pytest.raises(PipelineError, match="unknown stage 'vocoder'"):
        cat.routes("vocoder")
    with pytest.raises(UnknownPipeline, match=r"unknown pipeline 'nope'; this deployment serves \['omni-t', 'tts-t'\]"):
        cat.resolve("nope")
    with pytest.raises(UnknownPipeline, match="version 0123456789abcdef"):
        cat.resolve("omni-t@0123456789abcdef")
    assert cat.resolve(f"tts-t@{tts.digest}") is tts
    with pytest.raises(PipelineError, match="two pipelines are named 'omni-t'"):
        Catalog.of([omni, build_pipeline(omni_spec(max_words=3))])


def test_up_serves_every_pipeline_given_with_one_worker_pool_per_stage_name(tmp_path: Path) -> None:
    from omniflow.ops.up import Supervisor

    tts = tts_spec()
    tts["stages"]["talker"]["replicas"] = 2
    omni_path, tts_path = tmp_path / "omni.yaml", tmp_path / "tts.yaml"
    sup = Supervisor(settings=Settings(), pipeline=build_pipeline(omni_spec()), pipeline_path=omni_path,
                     more=((build_pipeline(tts), tts_path),))
    workers = [c.name for c in sup.plan_children() if c.name.startswith("worker")]
    assert workers == ["worker:thinker:0", "worker:talker:0", "worker:talker:1", "worker:code2wav:0"]
    assert sup.pipeline_env() == f"{omni_path.resolve()},{tts_path.resolve()}"     # what every child loads
    assert Settings(pipeline=sup.pipeline_env()).pipeline_paths() == [omni_path.resolve(), tts_path.resolve()]


# ---------------------------------------------------------------- a real engine
@pytest.fixture
async def deployment(valkey_url: str, settings_factory: Callable[..., Settings]) -> AsyncIterator[Callable[..., Any]]:
    """`await deployment(*pipelines)`: a reconciler serving them on the session's Valkey (no workers)."""
    made: list[Engine] = []

    async def make(*pipelines: Pipeline, **settings: Any) -> Engine:
        engine = Engine(valkey_url, settings_factory(valkey_url, **settings), Catalog.of(list(pipelines)))  # type: ignore[arg-type]
        made.append(engine)
        await engine.add_reconciler()
        return engine

    yield make
    for engine in made:
        for stop, _task in engine._tasks:
            stop.set()
        keys = [k async for k in engine.redis.scan_iter(match=f"{engine.settings.prefix}:*")]
        if keys:
            await engine.redis.delete(*keys)
        await engine.close()


async def test_one_worker_process_serves_the_shared_stage_of_two_pipelines(deployment: Any) -> None:
    omni, tts = build_pipeline(omni_spec()), build_pipeline(tts_spec())
    eng = await deployment(omni, tts)
    worker = await eng.add_worker("all")
    # five stages of two pipelines, three pools: the talker and code2wav of both are one executor each
    assert len(worker.pools) == 5 and len(unique_cores(worker.pools)) == 3
    assert worker.pools[omni.queue("talker")].executor is worker.pools[tts.queue("talker")].executor
    RecordingTalker.ran.clear()
    spoken = await run_to_end(eng.store, request("say this please", pipeline="tts-t"))
    answered = await run_to_end(eng.store, request("hello there"))
    assert spoken["state"] == answered["state"] == "completed"
    assert (spoken["pipeline"], spoken["pipeline_version"]) == ("tts-t", tts.digest)
    assert (answered["pipeline"], answered["pipeline_version"]) == ("omni-t", omni.digest)
    assert set(spoken["outputs"]) == {"code2wav"} and set(answered["outputs"]) == {"thinker", "code2wav"}
    assert spoken["outputs"]["code2wav"]["duration_s"] > 0 and answered["outputs"]["code2wav"]["duration_s"] > 0
    # the same executor instance ran the talker of both workflows
    assert RecordingTalker.ran[spoken["id"]] == RecordingTalker.ran[answered["id"]]
    # the registry has both, each served by this one worker
    rows = {r["name"]: r for r in await registry.snapshot(eng.redis, eng.store.keys)}
    assert rows["tts-t"]["version"] == tts.digest and rows["tts-t"]["workers"] == {
        "talker": [worker.id], "code2wav": [worker.id]}
    assert rows["omni-t"]["input_modalities"] == ["text"]


async def test_a_workflow_finishes_on_its_version_waiting_for_a_worker_of_it(deployment: Any) -> None:
    v1, v2 = build_pipeline(omni_spec()), build_pipeline(omni_spec(max_words=3))
    eng = await deployment(v1)
    for stage in v1.order:
        await eng.add_worker(stage)
    await registry.register(eng.redis, eng.store.keys, v2)      # e.g. by a v2 worker that is still loading
    late = await eng.store.submit(request("one two three four five six", pipeline=f"omni-t@{v2.digest}"))
    # a v1 workflow submitted after it completes on the v1 workers, which never claim the v2 one
    first = await run_to_end(eng.store, request("one two three four five six"))
    assert first["pipeline_version"] == v1.digest and first["outputs"]["thinker"]["text"].count(" ") == 7
    doc = await eng.store.document(late.id)
    assert doc["state"] == "pending" and doc["stages"]["thinker"]["status"] == "pending"
    # a worker of v2 joins (serving every stage, as in `up --colocate`): the workflow finishes on v2
    v2_worker = Worker(settings=eng.settings, pipeline=v2, stage="all", redis_url=eng.url)
    await eng._spawn(lambda stop: v2_worker.run(stop, grace_s=5), v2_worker.started)
    done = await eng.store.wait(late.id, timeout_s=20)
    assert done["state"] == "completed" and done["pipeline_version"] == v2.digest
    assert done["outputs"]["thinker"]["text"].count(" ") == 2          # v2's max_words=3
    assert {done["stages"][st]["replica"] for st in v2.order} == {v2_worker.id}


async def test_no_worker_of_its_version_fails_it_at_its_deadline_naming_the_version(deployment: Any) -> None:
    v1, v2 = build_pipeline(omni_spec()), build_pipeline(omni_spec(max_words=2))
    eng = await deployment(v1)
    await eng.add_worker("all")
    await registry.register(eng.redis, eng.store.keys, v2)
    sub = await eng.store.submit(request("hi", pipeline=f"omni-t@{v2.digest}", deadline_s=0.5))
    doc = await eng.store.wait(sub.id, timeout_s=20)
    assert doc["state"] == "failed" and doc["error_stage"] == "thinker"
    assert f"no worker serves pipeline 'omni-t' version {v2.digest}" in doc["error"]


async def test_unknown_pipelines_and_versions_are_refused_by_the_store(deployment: Any) -> None:
    eng = await deployment(build_pipeline(omni_spec()))
    with pytest.raises(UnknownPipeline, match=r"unknown pipeline 'nope'; this deployment serves \['omni-t'\]"):
        await eng.store.submit(request("hi", pipeline="nope"))
    with pytest.raises(UnknownPipeline, match="unknown pipeline 'omni-t' version 0000000000000000"):
        await eng.store.submit(request("hi", pipeline="omni-t@0000000000000000"))
    assert await eng.store.list() == []


async def test_a_worker_started_with_a_new_pipeline_adds_it_to_the_running_deployment(deployment: Any) -> None:
    omni, tts = build_pipeline(omni_spec()), build_pipeline(tts_spec())
    eng = await deployment(omni)            # the store (an API) and the reconciler know omni-t only
    await eng.add_worker("all")
    with pytest.raises(UnknownPipeline):
        await eng.store.submit(request("before", pipeline="tts-t"))
    newcomer = Worker(settings=eng.settings, pipeline=tts, stage="all", redis_url=eng.url)
    await eng._spawn(lambda stop: newcomer.run(stop, grace_s=5), newcomer.started)
    assert [p.name for p in await eng.store.pipelines()] == ["omni-t", "tts-t"]
    doc = await run_to_end(eng.store, request("now it speaks", pipeline="tts-t"))
    assert doc["state"] == "completed" and doc["pipeline_version"] == tts.digest
    assert {doc["stages"][st]["replica"] for st in tts.order} == {newcomer.id}


# ---------------------------------------------------------------- the CLI
async def test_the_cli_lists_pipelines_and_refuses_an_unknown_one(deployment: Any, tmp_path: Path) -> None:
    omni, tts = build_pipeline(omni_spec()), build_pipeline(tts_spec())
    eng = await deployment(omni, tts)
    worker = await eng.add_worker("all")
    env = cli_env(eng, tmp_path)
    paths = []
    for spec in (omni_spec(), tts_spec()):
        path = tmp_path / f"{spec['name']}.yaml"
        path.write_text(yaml.safe_dump(spec))
        paths.append(str(path))
    env["OMNIFLOW_PIPELINE"] = ",".join(paths)
    code, out, err = await omniflow("submit", "hi", "--pipeline", "nope", env=env)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "unknown pipeline 'nope'" in err and "omni-t" in err and "tts-t" in err
    code, out, err = await omniflow("submit", "speak up", "--pipeline", "tts-t", "--wait", "--json", env=env)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["pipeline"] == "tts-t" and doc["pipeline_version"] == tts.digest
    code, out, err = await omniflow("pipelines", "--json", env=env)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["tts-t"]["workers"]["talker"] == [worker.id] and rows["omni-t"]["current"]
    code, out, err = await omniflow("ls", "--json", env=env)
    assert code == 0, err
    assert [(r["pipeline"], r["pipeline_version"]) for r in json.loads(out)] == [("tts-t", tts.digest)]


async def test_bad_pipeline_flags_are_one_line_and_exit_2(tmp_path: Path) -> None:
    one, other = tmp_path / "one.yaml", tmp_path / "other.yaml"
    one.write_text(yaml.safe_dump(omni_spec()))
    other.write_text(yaml.safe_dump(omni_spec(max_words=3)))        # another version under the same name
    env = {"PATH": "/usr/bin:/bin", "OMNIFLOW_HOME": str(tmp_path / "home"), "OMNIFLOW_REDIS_URL": "redis://127.0.0.1:1/0"}
    for args, says in [(("up", "--no-api", "--pipeline", str(one), "--pipeline", str(other)), "two pipelines are named"),
                       (("worker", "--stage", "vocoder", "--pipeline", str(one)), "unknown stage 'vocoder'"),
                       (("api", "--pipeline", str(tmp_path / "missing.yaml")), "pipeline file not found")]:
        code, out, err = await omniflow(*args, env=env)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (args, err)
