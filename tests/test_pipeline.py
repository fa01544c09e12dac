"""Pipeline spec validation and planning (pure logic, no Redis)."""
from __future__ import annotations

import pytest

from omniflow.errors import InvalidRequest, PipelineError
from omniflow.pipeline import build_pipeline, load_pipeline
from omniflow.config import DEFAULT_PIPELINE

from conftest import toy_spec


def spec_with_edges(edges: list[dict[str, str]], **stage_overrides: dict) -> dict:
    spec = toy_spec()
    spec["edges"] = edges
    for name, over in stage_overrides.items():
        spec["stages"][name].update(over)
    return spec


def test_shipped_pipeline_loads() -> None:
    pipe = load_pipeline(DEFAULT_PIPELINE)
    assert pipe.order == ("thinker", "talker", "code2wav")
    assert pipe.finals == ("thinker", "code2wav")
    assert pipe.entry == "thinker"


def test_the_cpu_speech_pipelines_load_and_declare_the_voice_stages_as_omni_cpu_does() -> None:
    from pathlib import Path

    folder = Path(DEFAULT_PIPELINE).parent
    asr, tts, omni = (load_pipeline(folder / f"{name}.yaml") for name in ("asr-cpu", "tts-cpu", "omni-cpu"))
    assert (asr.name, asr.order, asr.finals, asr.stages["asr"].final_output) == ("asr-cpu", ("asr",), ("asr",), "text")
    assert asr.stages["asr"].executor == "omniflow.workers.asr:WhisperASR"
    assert (tts.name, tts.order, tts.finals) == ("tts-cpu", ("talker", "code2wav"), ("code2wav",))
    for stage in ("talker", "code2wav"):      # identical declarations: one worker pool once both are served
        assert tts.stages[stage] == omni.stages[stage]
    # omni-cpu hears as well as reads: audio starts at its ASR, which feeds the Thinker; text skips it
    assert asr.entries == {"audio": "asr"} and omni.entries == {"text": "thinker", "audio": "asr"}
    assert omni.plan().stages == ("thinker", "talker", "code2wav")
    assert omni.plan(input_kind="audio").stages == ("asr", "thinker", "talker", "code2wav")
    assert omni.stages["asr"].executor == asr.stages["asr"].executor and omni.stages["asr"].final_output is None


def test_edge_to_unknown_stage_is_refused_with_field_name() -> None:
    spec = spec_with_edges([{"from": "thinker", "to": "talker"}, {"from": "talker", "to": "vocoder"}])
    with pytest.raises(PipelineError, match=r"edges\[1\]\.to: unknown stage 'vocoder'"):
        build_pipeline(spec)


def test_unreachable_final_stage_is_refused() -> None:
    spec = spec_with_edges([{"from": "thinker", "to": "talker"}])
    with pytest.raises(PipelineError, match=r"stages\.code2wav: final stage is unreachable from entry stage 'thinker'"):
        build_pipeline(spec)


def test_entry_stage_with_inputs_is_refused() -> None:
    spec = spec_with_edges([{"from": "thinker", "to": "talker"}, {"from": "talker", "to": "code2wav"}])
    spec["entry"] = "talker"
    with pytest.raises(PipelineError, match="entry stage 'talker' cannot have inputs"):
        build_pipeline(spec)


def test_cycle_is_refused() -> None:
    spec = spec_with_edges([{"from": "thinker", "to": "talker"}, {"from": "talker", "to": "code2wav"},
                            {"from": "code2wav", "to": "talker"}])
    with pytest.raises(PipelineError, match="cycle"):
        build_pipeline(spec)


def test_edge_both_chunk_and_full_is_refused() -> None:
    spec = spec_with_edges([{"from": "thinker", "to": "talker", "mode": "chunk"},
                            {"from": "thinker", "to": "talker", "mode": "full"},
                            {"from": "talker", "to": "code2wav"}])
    with pytest.raises(PipelineError, match="both chunk and full"):
        build_pipeline(spec)


def test_unknown_field_and_bad_values_name_the_field() -> None:
    spec = toy_spec()
    spec["stages"]["talker"]["replicas"] = 0
    with pytest.raises(PipelineError, match=r"stages\.talker\.replicas"):
        build_pipeline(spec)
    spec = toy_spec()
    spec["stages"]["talker"]["gpu"] = 1
    with pytest.raises(PipelineError, match=r"stages\.talker\.gpu: Extra inputs"):
        build_pipeline(spec)
    spec = toy_spec()
    spec["stages"]["talker"]["executor"] = "no_colon_here"
    with pytest.raises(PipelineError, match="executor"):
        build_pipeline(spec)


def test_reserved_slots_must_leave_a_slot_and_leave_the_digest_alone() -> None:
    spec = toy_spec()
    spec["stages"]["thinker"].update(max_sessions=4, reserved_slots=4)
    with pytest.raises(PipelineError, match=r"stages\.thinker: .*reserved_slots \(4\) must be below max_sessions \(4\)"):
        build_pipeline(spec)
    spec["stages"]["thinker"]["reserved_slots"] = 1
    assert build_pipeline(spec).spec.stages["thinker"].reserved_slots == 1
    # the default headroom (reserved_slots unset) leaves a pipeline's version what it was before the
    # field existed (the digest names the task queues of a deployment being upgraded); the value is
    # storage layout 3's (layout 2's was e657775ac5bcd97f, layout 1's 6a4a30d601a56b10:
    # test_the_storage_layout_is_part_of_the_version)
    plain, explicit = toy_spec(), toy_spec()
    explicit["stages"]["thinker"]["reserved_slots"] = 1
    assert build_pipeline(plain).digest == "b7c8e08c2bd971b8" != build_pipeline(explicit).digest


def test_the_storage_layout_is_part_of_the_version() -> None:
    """A worker of a layout before must never read the queues of a workflow of this one: layout 1's
    (stage fields apart from the record) would take its tasks for stale and drop them, layout 2's
    would APPEND its text to a key no reader reads (layout 3: text in the record). The layout is
    hashed into the version, so they serve different queues; layout 1 hashed nothing more."""
    import omniflow.pipeline as pl

    assert pl.STORAGE_LAYOUT == 3
    layout3 = build_pipeline(toy_spec())
    dumped = layout3.spec.model_dump(mode="json", by_alias=True)
    dumped.pop("shedding")
    for stage_doc in dumped["stages"].values():
        stage_doc.pop("reserved_slots")
    assert pl._hash(dumped) == "6a4a30d601a56b10" != layout3.digest      # what layout 1 named its queues
    assert layout3.queue("thinker") != f"thinker@{pl._hash(dumped)}"
    assert layout3.digest != "e657775ac5bcd97f"                          # layout 2's


@pytest.mark.parametrize("name", ["state", "input", "tenant", "finished", "sl"])
def test_a_stage_may_not_be_named_like_a_record_field(name) -> None:
    """The record holds the stage fields too, a stage's status under the stage's own name."""
    spec = toy_spec()
    spec["stages"][name] = spec["stages"].pop("code2wav")
    with pytest.raises(PipelineError, match=rf"stages\.{name}: '{name}' is reserved \(a field of every workflow's record"):
        build_pipeline(spec)


def test_bad_yaml_file_is_refused(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(PipelineError, match="not valid YAML"):
        load_pipeline(bad)
    with pytest.raises(PipelineError, match="not found"):
        load_pipeline(tmp_path / "missing.yaml")


def test_output_modalities_must_be_subset_of_finals() -> None:
    pipe = build_pipeline(toy_spec())
    with pytest.raises(InvalidRequest, match="'video' is not produced"):
        pipe.plan(["text", "video"])
    with pytest.raises(InvalidRequest, match="at least one"):
        pipe.plan([])
    with pytest.raises(InvalidRequest, match="subset"):
        pipe.plan(final_stages=["talker"])


def test_plan_picks_required_stages_and_presubmits_chunk_successors() -> None:
    pipe = build_pipeline(toy_spec())
    text_only = pipe.plan(["text"])
    assert text_only.finals == ("thinker",)
    assert text_only.stages == ("thinker",)
    both = pipe.plan(["text", "audio"])
    assert both.stages == ("thinker", "talker", "code2wav")
    assert both.admit == ("thinker", "talker", "code2wav")
    assert both.groups == ()


def test_plan_defers_full_edge_successors() -> None:
    spec = spec_with_edges([{"from": "thinker", "to": "talker", "mode": "chunk"},
                            {"from": "talker", "to": "code2wav", "mode": "full"}])
    plan = build_pipeline(spec).plan(["audio"])
    assert plan.admit == ("thinker", "talker")
    assert plan.groups == ((("talker",), ("code2wav",)),)
