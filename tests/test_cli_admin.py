"""The operator's commands, run as a user runs them (subprocesses) against a real server and real
workers; every `--json` output is validated against the API's response models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf
from pydantic import TypeAdapter

import helpers
from conftest import toy_spec
from helpers import eventually, omniflow, request
from jobs_support import FAST, jobs_runner

from omniflow.api.schemas import Pools, WorkerView, WorkflowSummary
from omniflow.storage.schema import now_ms

FAIL_FAST = toy_spec(thinker={"fail_at_step": 1, "fail_retryable": False})


@pytest.fixture
def cli_env(tmp_path: Path):
    return lambda eng: helpers.cli_env(eng, tmp_path)


async def run_json(*args: str, env: dict[str, str]) -> object:
    code, out, err = await omniflow(*args, "--json", env=env)
    assert code == 0, err
    return json.loads(out)


async def test_stats_and_stats_watch_json(engine_factory, cli_env) -> None:
    async with engine_factory() as eng:
        env = cli_env(eng)
        sub = await eng.store.submit(request("for the stats"))
        await eng.store.wait(sub.id, timeout_s=10)
        pools = Pools.model_validate(await run_json("stats", env=env))
        assert pools.workflows["completed"] == 1 and pools.in_flight == 0
        assert {name: st.live_workers for name, st in pools.stages.items()} == {"thinker": 1, "talker": 1, "code2wav": 1}
        code, out, err = await omniflow("stats", "--watch", "--count", "2", "--interval", "0.2", "--json", env=env)
        assert code == 0, err
        lines = out.splitlines()
        assert len(lines) == 2 and all(Pools.model_validate_json(x).max_in_flight == eng.settings.max_in_flight
                                       for x in lines)
        code, out, _ = await omniflow("stats", "--watch", "--count", "2", "--interval", "0.2", env=env)
        assert code == 0 and "done/min" in out and "thinker" in out and "workers (3 live)" in out


async def test_workers_drain_and_undrain(engine_factory, cli_env) -> None:
    async with engine_factory() as eng:
        env = cli_env(eng)
        async def listed() -> list[WorkerView] | None:
            # every worker seen live (a heartbeat can be late on a loaded machine: wait for it, as a user would)
            rows = TypeAdapter(list[WorkerView]).validate_python(await run_json("workers", env=env))
            return rows if all(w.alive and w.heartbeat_age_s is not None and w.host for w in rows) else None

        rows = await eventually(listed, timeout_s=30, what="every worker listed as live")
        assert sorted(w.stages[0] for w in rows) == ["code2wav", "talker", "thinker"]
        # where each stage's sessions run (the toy stages say runs_on = "loop"), in the table too
        assert all(w.runs_on == {w.stages[0]: "loop"} for w in rows)
        code, out, _ = await omniflow("workers", env=env)
        assert code == 0 and out.count("(loop)") == 3, out
        thinker = eng.workers["thinker"][0]
        drained = WorkerView.model_validate(await run_json("drain", thinker.id, "--wait", "--timeout", "5", env=env))
        assert drained.draining and drained.sessions_held == 0
        await eventually(lambda: _true(thinker.draining))
        sub = await eng.store.submit(request("waits for the drain to lift"))
        assert (await eng.store.wait(sub.id, timeout_s=1.0))["stages"]["thinker"]["status"] == "pending"
        code, out, _ = await omniflow("workers", env=env)
        assert code == 0 and "draining" in out
        back = WorkerView.model_validate(await run_json("undrain", thinker.id, env=env))
        assert not back.draining
        assert (await eng.store.wait(sub.id, timeout_s=10))["state"] == "completed"


async def _true(value: bool) -> bool:
    return value


async def test_drain_wait_runs_out_of_time_with_exit_4_while_a_session_is_held(engine_factory, cli_env,
                                                                                tmp_path) -> None:
    import yaml

    # the session must outlast the CLI's start (several seconds on a loaded 2-core machine): ~10 s
    slow = toy_spec(thinker={"token_delay_s": 0.4, "max_words": 24})
    async with engine_factory(slow) as eng:
        env = cli_env(eng)
        (tmp_path / "slow.yaml").write_text(yaml.safe_dump(slow))
        env["OMNIFLOW_PIPELINE"] = str(tmp_path / "slow.yaml")
        sub = await eng.store.submit(request("a long one", ["text"]))
        thinker = eng.workers["thinker"][0]
        await eventually(lambda: _holds(eng, sub.id))
        code, out, err = await omniflow("drain", thinker.id, "--wait", "--timeout", "0.5", env=env)
        assert code == 4 and "still holds 1 session(s)" in out
        assert (await eng.store.wait(sub.id, timeout_s=40))["state"] == "completed"     # it finishes what it holds


async def _holds(eng, wf_id: str) -> bool:
    return (await eng.store.document(wf_id))["stages"]["thinker"]["status"] == "running"


async def test_ls_filters(engine_factory, cli_env) -> None:
    async with engine_factory(workers=False) as eng:
        env = cli_env(eng)
        text = await eng.store.submit(request("t", ["text"], request_id="invoice-0042"), tenant="acme")
        first_ms = now_ms()         # newest first is by submit time in ms: the second must not share its ms
        await eventually(lambda: now_ms() > first_ms, timeout_s=10, interval_s=0.001, what="the clock to tick")
        audio = await eng.store.submit(request("a", request_id="invoice-0043"), tenant="globex")
        adapter = TypeAdapter(list[WorkflowSummary])

        async def ids(*args: str) -> list[str]:
            return [row.id for row in adapter.validate_python(await run_json("ls", *args, env=env))]

        assert await ids() == [audio.id, text.id]
        assert await ids("--stage", "code2wav") == [audio.id]
        assert await ids("--tenant", "acme") == [text.id]
        assert await ids("--request-id", "0042") == [text.id]
        assert await ids("--since", "10m", "--state", "pending") == [audio.id, text.id]
        assert await ids("--state", "completed") == []


async def test_purge_older_than_deletes_finished_workflows_only(engine_factory, cli_env) -> None:
    async with engine_factory(workers=False) as eng:
        env = cli_env(eng)
        done = await eng.store.submit(request("finished", request_id="purge-me"))
        await eng.store.abort(done.id)
        live = await eng.store.submit(request("still live"))
        listed_ms = await eng.redis.zscore(eng.store.keys.state_index("aborted", 0), done.id)     # what purge compares
        await eventually(lambda: now_ms() - listed_ms > 1000, timeout_s=10, interval_s=0.05,
                         what="the finished workflow older than 1 s")
        code, _, err = await omniflow("purge", "--older-than", "1s", env=env)       # no terminal, no --yes
        assert code == 2 and "Delete 1 completed/failed/aborted workflow(s)" in err and "--yes" in err
        assert await eng.store.state(done.id) is not None
        assert await run_json("purge", "--older-than", "1s", "--state", "completed", "--yes", env=env) == {
            "deleted_workflows": 0}
        assert await run_json("purge", "--older-than", "1s", "--yes", env=env) == {"deleted_workflows": 1}
        assert await eng.store.state(done.id) is None and await eng.store.state(live.id) is not None
        assert not await eng.redis.exists(eng.store.keys.log(done.id), eng.store.keys.idem("default", "purge-me"))
        assert await eng.redis.zscore(eng.store.keys.state_index("aborted", 0), done.id) is None
        assert [r["id"] for r in await eng.store.list()] == [live.id]
        deleted = await run_json("purge", "--all", "--yes", env=env)
        assert deleted["deleted_keys"] > 0 and await eng.store.state(live.id) is None


async def test_dlq_ls_replay_and_drop(engine_factory, cli_env) -> None:
    async with engine_factory(FAIL_FAST) as eng:
        env = cli_env(eng)
        failed = [await eng.store.submit(request(f"dead {i}", ["text"])) for i in range(3)]
        for sub in failed:
            assert (await eng.store.wait(sub.id, timeout_s=10))["state"] == "failed"
        rows = await run_json("dlq", "ls", "--stage", "thinker", env=env)
        assert sorted(r["wf"] for r in rows) == sorted(s.id for s in failed) and {r["dlq"] for r in rows} == {"thinker"}
        assert await run_json("dlq", "ls", "talker", env=env) == []
        one = rows[0]
        replayed = await run_json("dlq", "replay", "thinker", "--entry", one["entry"], env=env)
        assert [r["wf"] for r in replayed] == [one["wf"]] and replayed[0]["new_id"] != one["wf"]
        assert (await eng.store.wait(replayed[0]["new_id"], timeout_s=10))["state"] == "failed"   # poison again
        everything = await run_json("dlq", "replay", "--all", env=env)
        assert {r["wf"] for r in everything if "new_id" in r} == \
            {s.id for s in failed} - {one["wf"]} | {replayed[0]["new_id"]}
        # the replays failed again (same poison input): new dead letters, dropped with confirmation
        await eventually(lambda: _dlq_len(eng, 3))
        code, _, err = await omniflow("dlq", "drop", "thinker", env=env)
        assert code == 2 and "Delete 3 dead letter(s) from thinker?" in err
        first = (await run_json("dlq", "ls", "thinker", env=env))[0]["entry"]
        assert await run_json("dlq", "drop", "thinker", "--entry", first, "--yes", env=env) == {"deleted": 1}
        assert await run_json("dlq", "drop", "--all", "--yes", env=env) == {"deleted": 2}
        assert await run_json("dlq", "ls", env=env) == []


async def _dlq_len(eng, n: int) -> bool:
    return await eng.redis.xlen(eng.store.keys.dlq("thinker", 0)) == n


async def test_batch_results_jsonl_with_audio_and_an_unwrapped_stderr_report(engine_factory, cli_env,
                                                                              tmp_path) -> None:
    long_junk = '{"text": "' + "x" * 150            # not JSON: its error line is longer than 80 columns
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join([json.dumps({"text": "one"}), json.dumps({"text": "two", "output_modalities": ["text"]}),
                               long_junk]) + "\n")
    async with engine_factory(**FAST) as eng, jobs_runner(eng):
        env = cli_env(eng)
        code, out, err = await helpers.run_cli("-m", "omniflow.cli", "batch", "submit", str(path), env=env)
        assert code == 0, err
        batch_id = out.strip()
        report = [line for line in err.splitlines() if line.startswith("line ")]
        assert len(report) == 1 and report[0].startswith("line 3: not JSON") and len(report[0]) < 200
        assert len(err.splitlines()) == 1                 # one line, however narrow the (piped) stderr
        code, _, err = await helpers.run_cli("-m", "omniflow.cli", "batch", "submit", str(path), "--wait",
                                             "--timeout", "0.001", env=env)
        assert code in (1, 4)                              # 4 while running; 1 if it ended (line 3 is invalid)
        await _batch_done(eng, batch_id)
        audio_dir = tmp_path / "audio"
        audio_dir.mkdir()
        code, out, err = await helpers.run_cli("-m", "omniflow.cli", "batch", "results", batch_id,
                                               "--audio-dir", str(audio_dir), env=env)
        assert code == 0, err
        rows = [json.loads(x) for x in out.splitlines()]
        assert [(r["line"], r["state"]) for r in rows] == [(1, "completed"), (2, "completed"), (3, "invalid")]
        assert all(set(r) == {"line", "workflow_id", "state", "text", "audio_path", "error"} for r in rows)
        assert rows[0]["text"].startswith("You said: one") and rows[1]["text"].startswith("You said: two")
        assert rows[1]["audio_path"] is None and rows[2]["workflow_id"] is None and "not JSON" in rows[2]["error"]
        data, rate = sf.read(rows[0]["audio_path"], dtype="int16")
        assert Path(rows[0]["audio_path"]).parent == audio_dir and rate == 22050 and len(data) > 0
        code, _, err = await helpers.run_cli("-m", "omniflow.cli", "batch", "results", "no-such-batch", env=env)
        assert code == 2 and "no batch no-such-batch" in err


async def _batch_done(eng, batch_id: str) -> None:
    from omniflow.jobs.batch import wait_batch

    assert (await wait_batch(eng.store, batch_id, timeout_s=20))["state"] == "failed"     # line 3 is invalid


async def test_scripts_lists_the_libraries_and_prunes_only_other_omniflow_versions(valkey_url, tmp_path) -> None:
    """`omniflow scripts`: this version's library and an older one (an upgrade leaves it) are listed;
    `--prune` deletes the old one only, never another program's; a call of this version still works."""
    from types import SimpleNamespace

    from omniflow.ops.admin import _library_row
    from omniflow.storage import redisio
    from omniflow.storage.scripts import LIBRARY_NAME, SCRIPTS

    redis = redisio.connect(valkey_url)
    old, other = "omniflow_000000000000", "someoneelse"
    try:
        await redisio.load_scripts(redis)
        for name in (old, other):
            await redis.raw.function_load(f"#!lua name={name}\nredis.register_function('{name}_f', "
                                          "function() return 1 end)", replace=True)
        env = helpers.cli_env(SimpleNamespace(url=valkey_url, settings=SimpleNamespace(prefix="t-scripts")), tmp_path)
        rows = await run_json("scripts", env=env)
        assert [(r["library"], r["current"]) for r in rows] == [(LIBRARY_NAME, True), (old, False)]
        assert rows[0]["functions"] == len(SCRIPTS)
        code, _, err = await omniflow("scripts", "--prune", env=env)           # no terminal, no --yes
        assert code == 2 and "--yes" in err
        assert await run_json("scripts", "--prune", "--yes", env=env) == {"deleted": [old]}
        left = {_library_row(r)["library"] for r in await redis.function_list("*")}
        assert old not in left and {LIBRARY_NAME, other} <= left
        assert await redisio.script(redis, "heartbeat", ["t-scripts:{workers}", "t-scripts:{workers}:w"],
                                    ["w", 1, 60, "stage", "x"]) is None
    finally:
        for name in (old, other):
            if name in {_library_row(r)["library"] for r in await redis.function_list(name)}:
                await redis.function_delete(name)
        await redis.delete("t-scripts:{workers}", "t-scripts:{workers}:w")
        await redis.aclose()
