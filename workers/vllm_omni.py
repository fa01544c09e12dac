"""Qwen3-Omni on vLLM-Omni: Thinker, Talker and Code2Wav executors for CUDA machines.

Each executor drives one vLLM-Omni stage engine (`AsyncOmniLLM`, which batches its
requests internally), the way vLLM-Omni's own stage workers do
(`vllm_omni/entrypoints/omni_stage.py`): `AsyncOmniEngineArgs(model=..., **engine_args)`
-> `create_engine_config()` -> `AsyncOmniLLM.from_vllm_config()`, then
`async for out in engine.generate(prompt, sampling_params, request_id)`. The stage
inputs are built as `vllm_omni/model_executor/stage_input_processors/qwen3_omni.py`
builds them (`thinker2talker`, `talker2code2wav`), but from omniflow's durable edges:

- `VllmThinker` streams text deltas (checkpointing the token ids so a retry prefills them
  and continues) and, when done, sends the Talker the engine's latent outputs: the input
  embeddings (`"0"`), layer-24 hidden states (`"24"`), the TTS special embeddings and the
  token ids, as bf16/int64 tensors;
- `VllmTalker` turns them into 16-codebook codec codes (one chunk, the whole utterance:
  this vLLM-Omni version does not stream thinker to talker);
- `VllmCode2Wav` decodes the codes with the model's codec decoder (24 kHz) and emits the
  audio in pieces.

Placement (`devices` param, set as `CUDA_VISIBLE_DEVICES` before CUDA starts): Thinker
on GPU 0, Talker and Code2Wav on GPU 1, as in the reference deployment.

`vllm`, `vllm_omni` and CUDA are imported in `setup()` only, never at import time and never
on a CPU path; without them `setup()` refuses with one line (`ConfigError`).
"""
from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from omniflow.errors import ConfigError, NonRetryableError
from omniflow.executor import Executor, Session
from omniflow.workers.thinker import checkpoint_piece, checkpointed_ids

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
CODE2WAV_SAMPLE_RATE = 24000
AUDIO_PIECE_S = 1.0
TALKER_CODEC_EOS_TOKEN_ID = 2150
DEFAULT_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
                         "perceiving auditory and visual inputs, as well as generating text and speech.")
# Roles in the Thinker prompt, as `_compute_talker_prompt_ids_length` reads them.
IM_START, SYSTEM, USER, ASSISTANT = 151644, 8948, 872, 77091

# The reference stage configs (vllm_omni/model_executor/stage_configs/qwen3_omni_moe.yaml).
STAGE_ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "thinker": {"model_stage": "thinker", "engine_output_type": "latent", "hf_config_name": "thinker_config",
                "worker_cls": "vllm_omni.worker.gpu_ar_worker.GPUARWorker",
                "scheduler_cls": "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler",
                "gpu_memory_utilization": 0.6},
    "talker": {"model_stage": "talker", "engine_output_type": "latent", "hf_config_name": "talker_config",
               "worker_cls": "vllm_omni.worker.gpu_ar_worker.GPUARWorker",
               "scheduler_cls": "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler",
               "gpu_memory_utilization": 0.3},
    "code2wav": {"model_stage": "code2wav", "engine_output_type": "audio", "hf_config_name": "thinker_config",
                 "worker_cls": "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker",
                 "scheduler_cls": "vllm_omni.core.sched.omni_generation_scheduler.OmniGenerationScheduler",
                 "gpu_memory_utilization": 0.1, "max_num_batched_tokens": 1000000},
}
COMMON_ENGINE_ARGS = {"model_arch": "Qwen3OmniMoeForConditionalGeneration", "enforce_eager": True,
                      "trust_remote_code": True, "enable_prefix_caching": False, "distributed_executor_backend": "mp"}
DEFAULT_SAMPLING: dict[str, dict[str, Any]] = {
    "thinker": {"temperature": 0.4, "top_p": 0.9, "max_tokens": 2048, "seed": 42, "repetition_penalty": 1.05},
    "talker": {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
               "repetition_penalty": 1.05, "stop_token_ids": [TALKER_CODEC_EOS_TOKEN_ID]},
    "code2wav": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42,
                 "repetition_penalty": 1.1},
}


def require_gpu_stack(stage: str) -> None:
    """Refuse with one line unless vllm, vllm_omni and a CUDA device are all here."""
    missing = [name for name in ("vllm", "vllm_omni") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"{stage}: the vLLM executors need {' and '.join(missing)} "
                          "(install omniflow's gpu extra on a CUDA machine); use deploy/pipelines/omni-cpu.yaml here")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{stage}: the vLLM executors need a CUDA GPU and none is visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                          "use deploy/pipelines/omni-cpu.yaml on a CPU")


class _VllmStage(Executor):
    """One vLLM-Omni stage engine per worker process."""

    kind = "thinker"
    runs_on = "loop"      # pure asyncio: the engine computes in its own processes

    async def setup(self) -> None:
        devices = self.params.get("devices")
        if devices is not None:       # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = str(devices)
        require_gpu_stack(self.stage)
        from vllm.usage.usage_lib import UsageContext
        from vllm_omni.engine.arg_utils import AsyncOmniEngineArgs
        from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM

        engine_args = {**COMMON_ENGINE_ARGS, **STAGE_ENGINE_ARGS[self.kind], **self.params.get("engine_args", {})}
        engine_args["max_num_seqs"] = int(self.params.get("max_batch", 8))
        args = AsyncOmniEngineArgs(model=str(self.params.get("model", DEFAULT_MODEL)), **engine_args)
        usage = UsageContext.OPENAI_API_SERVER
        self.engine = AsyncOmniLLM.from_vllm_config(vllm_config=args.create_engine_config(usage_context=usage),
                                                    usage_context=usage, engine_args=args)

    def sampling(self, session: Session) -> Any:
        from vllm import SamplingParams

        known = {"temperature", "top_p", "top_k", "max_tokens", "seed", "repetition_penalty", "detokenize",
                 "stop_token_ids"}
        overrides = {k: v for k, v in session.params.items() if k in known}
        return SamplingParams(**{**DEFAULT_SAMPLING[self.kind], **self.params.get("sampling", {}), **overrides})

    async def generate(self, prompt: Any, session: Session) -> Any:
        """The engine's outputs for one request; the request is aborted if the session is cancelled."""
        request_id = f"{session.wf_id}:{self.stage}:{session.attempt}:{uuid.uuid4().hex[:6]}"
        try:
            async for out in self.engine.generate(prompt, self.sampling(session), request_id):
                yield out
        except BaseException:
            await self.engine.abort(request_id)
            raise

    async def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None


class VllmThinker(_VllmStage):
    """Qwen3-Omni Thinker: text deltas; the latent outputs for the Talker at the end."""

    kind = "thinker"

    async def run(self, session: Session) -> Mapping[str, Any]:
        if not session.text.strip():
            raise NonRetryableError("thinker: empty prompt")
        tokenizer = await self.engine.get_tokenizer()
        system = session.params.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
        text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{session.text}<|im_end|>\n"
                "<|im_start|>assistant\n")
        prompt_ids = list(tokenizer.encode(text))
        emitted = checkpointed_ids(session.checkpoint)
        session.fast_forward()         # continue after what earlier attempts wrote
        shown = tokenizer.decode(emitted, skip_special_tokens=True)
        final, saved = None, len(emitted)
        async for out in self.generate({"prompt_token_ids": prompt_ids + emitted}, session):
            final = out.outputs[0]
            ids = emitted + list(final.token_ids)
            full = tokenizer.decode(ids, skip_special_tokens=True)
            if len(full) > len(shown) and not full.endswith("\ufffd"):
                await session.emit(text=full[len(shown):], checkpoint=checkpoint_piece(ids[saved:]))
                shown, saved = full, len(ids)
        if final is None:
            raise NonRetryableError("thinker: the engine returned nothing")
        import torch

        mm = final.multimodal_output
        latent = {key: mm[key].detach().to("cpu", torch.bfloat16)
                  for key in ("0", "24", "tts_bos_embed", "tts_eos_embed", "tts_pad_embed")}
        await session.emit(data={**latent, "prompt_ids": np.asarray(prompt_ids, dtype=np.int64),
                                 "sequence_ids": np.asarray(prompt_ids + emitted + list(final.token_ids),
                                                            dtype=np.int64)})
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(emitted) + len(final.token_ids),
                "resumed_at": len(emitted)}


def talker_prompt_length(prompt_ids: list[int], sequence_len: int) -> int:
    """vLLM-Omni's `_compute_talker_prompt_ids_length`: user turns, plus 9 for the last assistant turn."""
    starts = [i for i, tok in enumerate(prompt_ids) if tok == IM_START] + [sequence_len]
    total = 0
    for n, (s, e) in enumerate(itertools.pairwise(starts)):
        role = prompt_ids[s + 1] if s + 1 < len(prompt_ids) else None
        if role == USER:
            total += e - s
        elif role == ASSISTANT and n == len(starts) - 2:
            total += 9
    return total


class VllmTalker(_VllmStage):
    """Qwen3-Omni Talker: the Thinker's latents -> 16-codebook codec codes."""

    kind = "talker"

    async def run(self, session: Session) -> Mapping[str, Any]:
        import torch
        from vllm_omni.inputs.data import OmniTokensPrompt

        latent: dict[str, Any] = {}
        async for chunk in session.inputs():
            latent.update(chunk.data)
        if "24" not in latent:
            raise NonRetryableError("talker: no thinker latents on the edge")
        if session.fast_forward():       # the one chunk of codes was written by an earlier attempt
            return {"codes": 0, "resumed": True}
        prompt_ids = [int(i) for i in latent["prompt_ids"]]
        sequence = [int(i) for i in latent["sequence_ids"]]
        info = {"thinker_embeddings": torch.as_tensor(latent["0"]).float().cuda(),
                "thinker_hidden_states": torch.as_tensor(latent["24"]).float().cuda(),
                "thinker_sequences": sequence, "thinker_input_ids": prompt_ids,
                **{k: torch.as_tensor(latent[k]).float().cuda()
                   for k in ("tts_bos_embed", "tts_eos_embed", "tts_pad_embed")}}
        prompt = OmniTokensPrompt(prompt_token_ids=[0] * talker_prompt_length(prompt_ids, len(sequence)),
                                  additional_information=info, multi_modal_data=None, mm_processor_kwargs=None)
        final = None
        async for out in self.generate(prompt, session):
            final = out.outputs[0]
        if final is None:
            raise NonRetryableError("talker: the engine returned nothing")
        codes = final.multimodal_output["code_predictor_codes"].to(torch.long).cpu()   # [frames, 16]
        await session.emit(data={"codes": codes.transpose(0, 1).contiguous()})          # [16, frames]
        return {"codec_frames": int(codes.shape[0])}


class VllmCode2Wav(_VllmStage):
    """Qwen3-Omni codec decoder: codes -> 24 kHz audio, emitted in one-second pieces."""

    kind = "code2wav"

    async def run(self, session: Session) -> Mapping[str, Any]:
        from vllm_omni.inputs.data import OmniTokensPrompt

        codes: list[int] = []
        async for chunk in session.inputs():
            codes += [int(c) for c in np.asarray(chunk.data["codes"]).reshape(-1)]
        if not codes:
            raise NonRetryableError("code2wav: no codes on the edge")
        final = None
        prompt = OmniTokensPrompt(prompt_token_ids=codes, multi_modal_data=None, mm_processor_kwargs=None)
        async for out in self.generate(prompt, session):
            final = out.outputs[0]
        if final is None:
            raise NonRetryableError("code2wav: the engine returned nothing")
        audio = final.multimodal_output["audio"].float().cpu().numpy().reshape(-1)
        piece = int(CODE2WAV_SAMPLE_RATE * AUDIO_PIECE_S)
        for start in range(0, audio.size, piece):      # decoding is deterministic: replays are suppressed
            await session.emit(audio=audio[start:start + piece], sample_rate=CODE2WAV_SAMPLE_RATE)
        return {"audio_seconds": round(audio.size / CODE2WAV_SAMPLE_RATE, 3)}
