"""The executor contract (`omniflow.executor`), without Redis.

The engine's session and `FakeSession` both implement the `Session` Protocol member by member
(mypy checks the same where each class is defined); docs/executors.md lists exactly its members;
where an executor can see a difference, the fake behaves as the engine's session does; the old
import path still works; the contract depends on nothing of the engine.
"""
from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import omniflow.executor
import omniflow.workers.base
from omniflow.dataplane import codec
from omniflow.engine.session import Session as EngineSession
from omniflow.models import SessionState
from omniflow.errors import Fenced
from omniflow.executor import Chunk, Session
from omniflow.testing import FakeSession

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- member by member
def protocol_members(proto: type) -> dict[str, Any]:
    return {name: value for name, value in vars(proto).items() if not name.startswith("_")}


def _resolve(owner: type, annotation: Any) -> Any:
    """An annotation as an object (they are strings under `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        return eval(annotation, vars(sys.modules[owner.__module__]))
    return annotation


def _data_type(cls: type, name: str) -> Any:
    """The declared type of data member `name` of `cls`: a property's return type, or an attribute's
    (dataclass field's) annotation; None when `cls` has no such member."""
    attr = inspect.getattr_static(cls, name, None)
    if isinstance(attr, property):
        return _resolve(cls, inspect.signature(attr.fget).return_annotation)
    for klass in cls.__mro__:
        annotations = vars(klass).get("__annotations__", {})
        if name in annotations:
            return _resolve(klass, annotations[name])
    return None


def contract_breaches(cls: type, proto: type = Session) -> list[str]:
    """Where `cls` differs from the Protocol: a missing member, another signature, another type."""
    breaches = []
    for name, member in protocol_members(proto).items():
        if isinstance(member, property):
            want, got = _resolve(proto, inspect.signature(member.fget).return_annotation), _data_type(cls, name)
            if got is None:
                breaches.append(f"{name}: missing")
            elif got != want:
                breaches.append(f"{name}: {got} instead of {want}")
            continue
        impl = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(impl):
            breaches.append(f"{name}: missing")
            continue
        want_sig, got_sig = inspect.signature(member, eval_str=True), inspect.signature(impl, eval_str=True)
        if got_sig != want_sig:
            breaches.append(f"{name}: {got_sig} instead of {want_sig}")
        if inspect.iscoroutinefunction(impl) != inspect.iscoroutinefunction(member):
            breaches.append(f"{name}: {'a coroutine' if inspect.iscoroutinefunction(member) else 'not a coroutine'} "
                            "in the Protocol")
    return breaches


@pytest.mark.parametrize("cls", [EngineSession, FakeSession], ids=["engine-session", "fake-session"])
def test_both_sessions_implement_the_protocol_member_by_member(cls: type) -> None:
    assert contract_breaches(cls) == []


def test_a_drifted_session_is_caught() -> None:
    class Drifted(FakeSession):
        async def emit(self, *, text: str | None = None) -> None:       # lost its other keywords
            return None

        def fast_forward(self, to: int = 0) -> int:
            return to

    class Bare:
        stage: int = 0          # the wrong type

    assert sorted(b.split(":")[0] for b in contract_breaches(Drifted)) == ["emit", "fast_forward"]
    bare = dict(b.split(": ", 1) for b in contract_breaches(Bare))
    assert bare.pop("stage").startswith("<class 'int'> instead of")
    assert set(bare) == set(protocol_members(Session)) - {"stage"} and set(bare.values()) == {"missing"}


def test_the_docs_list_exactly_the_protocol_members() -> None:
    text = (ROOT / "docs" / "executors.md").read_text()
    section = text.split("## What a session gives you", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"session\.([a-z_]+)", section))
    assert documented == set(protocol_members(Session))


# ---------------------------------------------------------------- what an executor sees
def engine_session(**kw: Any) -> EngineSession:
    """The engine's session with no worker behind it: enough for what never reaches Redis (the inputs
    the claim returned, fencing, suppressed resume steps). Anything that would write fails loudly."""
    defaults: dict[str, Any] = dict(wf_id="wf-test", stage="talker", attempt=1, input={}, params={},
                                    finals=("talker",), downstream=(), resume_seq=0, _batcher=None, _keys=None)
    return EngineSession(**{**defaults, **kw})


def _entry(chunk: Chunk) -> tuple[str, dict[bytes, bytes]]:
    return chunk.src, {b"seq": str(chunk.seq).encode(), b"a": str(chunk.attempt).encode(), b"d": codec.dumps(chunk.data)}


async def _read(session: Any) -> list[Chunk]:
    return [chunk async for chunk in session.inputs()]


async def test_inputs_drop_replayed_chunks_in_both_sessions() -> None:
    """A retried producer's replay or a duplicated entry reaches a consumer again: (src, seq) decides."""
    sent = [Chunk("thinker", 1, 1, {"w": "a"}), Chunk("thinker", 1, 2, {"w": "a again"}),
            Chunk("thinker", 2, 2, {"w": "b"}), Chunk("asr", 1, 1, {"w": "z"}), Chunk("thinker", 2, 2, {"w": "b again"}),
            Chunk("thinker", 3, 2, {"w": "c"})]
    want = [sent[0], sent[2], sent[3], sent[5]]
    ends = [("thinker", {b"eos": b"1"}), ("asr", {b"eos": b"1"})]
    engine = engine_session(upstream=("thinker", "asr"), _catchup=[*(_entry(c) for c in sent), *ends])
    assert await _read(engine) == want
    assert await _read(FakeSession(stage="talker", chunks=sent)) == want


async def test_inputs_drop_replayed_live_chunks_in_the_fake_session() -> None:
    fake = FakeSession(stage="talker", upstream=("thinker",), live=True)
    for chunk in (Chunk("thinker", 1, 1, "a"), Chunk("thinker", 1, 1, "a"), Chunk("thinker", 2, 1, "b"), None):
        fake.feed(chunk)
    assert [c.data for c in await _read(fake)] == ["a", "b"]


@pytest.mark.parametrize("make", [lambda: engine_session(state=SessionState.FENCED), lambda: FakeSession(fenced=True)],
                         ids=["engine-session", "fake-session"])
async def test_a_fenced_session_refuses_emit_and_flush(make: Any) -> None:
    session = make()
    with pytest.raises(Fenced):
        await session.emit(text="late")
    with pytest.raises(Fenced):
        await session.flush()


@pytest.mark.parametrize("make", [lambda: engine_session(resume_seq=2, checkpoint="7 8 "),
                                  lambda: FakeSession(stage="talker", resume_seq=2, checkpoint="7 8 ")],
                         ids=["engine-session", "fake-session"])
async def test_steps_up_to_resume_seq_are_suppressed(make: Any) -> None:
    session = make()
    await session.emit(text="one")
    await session.emit(text="two")      # both were written by an earlier attempt: nothing is written
    assert (session.seq, session.fast_forward(), session.checkpoint) == (2, 2, "7 8 ")


# ---------------------------------------------------------------- where the contract lives
def test_the_old_import_path_re_exports_the_contract() -> None:
    for name in omniflow.workers.base.__all__:
        assert getattr(omniflow.workers.base, name) is getattr(omniflow.executor, name)
    assert {"Executor", "BatchedExecutor", "Session", "Chunk", "StepOutput"} <= set(omniflow.workers.base.__all__)


def _omniflow_imports(path: Path) -> set[str]:
    """Every omniflow module a file imports, at any depth (inside functions and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("omniflow"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("omniflow"))
    return found


def test_the_contract_depends_on_nothing_of_the_engine() -> None:
    """The engine, the workers and the fake import the contract: it imports only the error tree and,
    in one direction (base <- stepping <- batched), itself; so no import cycle can go through it."""
    order = ["base", "stepping", "batched"]
    package = ROOT / "omniflow" / "executor"
    for i, name in enumerate(order):
        allowed = {"omniflow.errors", *(f"omniflow.executor.{m}" for m in order[:i])}
        assert _omniflow_imports(package / f"{name}.py") <= allowed, name
    assert _omniflow_imports(package / "__init__.py") <= {"omniflow.errors", *(f"omniflow.executor.{m}" for m in order)}
    assert sorted(p.stem for p in package.glob("*.py")) == sorted(["__init__", *order])


# ---------------------------------------------------------------- the docs' first example runs
async def test_the_docs_first_executor_runs_on_the_contract() -> None:
    from docs_examples import docs_example

    from omniflow.errors import NonRetryableError
    from omniflow.testing import run_executor

    upper = docs_example("executors.md", "Upper")["Upper"](stage="upper", params={"suffix": "?"})
    await upper.setup()
    session = FakeSession(input={"text": "is it durable"}, stage="upper")
    assert await run_executor(upper, session) == {"tokens": 3}
    assert session.text_out == "IS IT DURABLE?"
    with pytest.raises(NonRetryableError):
        await run_executor(upper, FakeSession(input={"text": "  "}, stage="upper"))
