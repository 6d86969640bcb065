"""The generation API: LLM(model_dir).generate(prompt) yields text pieces as they decode."""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.loader import load_model
from engine.sampling import SamplingParams, TokenLogprobs
from engine.tokenizer import StreamDecoder

DEFAULT_MODEL_NAME = "models/smollm2-135m-instruct"  # in the repository; what the help shows
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / DEFAULT_MODEL_NAME
BACKENDS = ("auto", "cuda", "numpy")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0  # first token to last
    ttft: float = 0.0  # request start to first token
    stop_reason: str = ""  # eos | stop | length | context (the CLI adds interrupted | closed)

    @property
    def tok_per_s(self) -> float:
        return (self.new_tokens - 1) / self.seconds if self.new_tokens > 1 and self.seconds > 0 else 0.0


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


class LLM:
    """A loaded model on one backend ("auto" picks CUDA when a GPU is present, else numpy)."""

    def __init__(self, model_dir: str | Path = DEFAULT_MODEL, backend: str = "auto",
                 max_context: int | None = None, use_graph: bool = True,
                 notice: Callable[[str], None] = _stderr, quantize: str | None = None):
        if backend not in BACKENDS:
            raise GDecodeError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
        model_dir = Path(model_dir)
        if not model_dir.exists() and model_dir == DEFAULT_MODEL:
            raise GDecodeError(f"default model not found at {model_dir}: run `make model` or pass --model PATH")
        if max_context is not None and max_context < 2:
            raise GDecodeError(f"--max-context must be at least 2, got {max_context}")
        if quantize is not None:
            from engine.loader import stored_quantization
            from engine.qweights import check_format, check_quantize

            check_format(quantize)
            already = stored_quantization(model_dir)
            if already:
                raise GDecodeError(f"--quantize {quantize}: {model_dir} is already quantized ({already}); "
                                   "--quantize applies to bf16, fp16 and fp32 models")
        loaded = load_model(model_dir)
        self.cfg, self.tokenizer, weights = loaded.cfg, loaded.tokenizer, loaded.weights
        limit = self.cfg.max_position_embeddings
        if max_context is not None and max_context > limit:
            raise GDecodeError(f"--max-context {max_context} is above the model's limit of {limit} positions "
                               "(max_position_embeddings, capped by any sliding window)")
        if quantize is not None:
            check_quantize(weights, quantize, str(model_dir))
        self.quantize, self.gguf = quantize, loaded.gguf
        self.backend = self._make_backend(backend, weights, max_context, use_graph, notice)
        self.stats = GenerationStats()
        self.logprobs: list[TokenLogprobs] = []
        self._warm_up_text()

    def _warm_up_text(self) -> None:
        """Compile the chat template and run the tokenizer and detokenizer once, so that the first request
        after load does not pay for it (the backend warms up its kernels itself)."""
        tok, most = self.tokenizer, self.max_context  # with a limit, as requests come: it sizes the vocabulary once
        try:
            ids = (tok.encode_chat([{"role": "user", "content": "Hello"}], max_tokens=most) if tok.chat_template
                   else tok.encode("Hello", max_tokens=most))
        except GDecodeError:
            return  # a template that cannot render says so on first use
        if ids:
            dec = StreamDecoder(tok, context=ids[:-1])
            dec.push(ids[-1])
            dec.flush()

    def _make_backend(self, backend, weights, max_context, use_graph, notice):
        if backend in ("auto", "cuda"):
            from kernels.cuda import gpu_available

            if gpu_available():
                from engine.backend_cuda import CudaBackend

                quant = {"quantize": self.quantize} if self.quantize else {}
                return CudaBackend(self.cfg, weights, max_context=max_context, use_graph=use_graph, **quant)
            if backend == "cuda":
                raise GDecodeError("--backend cuda: no CUDA GPU found")
            notice("no CUDA GPU found: using the numpy backend")
        from engine.backend_numpy import DEFAULT_MAX_CONTEXT, NumpyBackend

        if self.gguf:
            from engine.qweights import dequantized

            weights = dequantized(weights)  # the bf16 values import-gguf writes
        _check_host_memory(self.cfg, max_context or min(self.cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT))
        return NumpyBackend(self.cfg, weights, max_context=max_context, quantize=self.quantize)

    @property
    def max_context(self) -> int:
        return self.backend.max_context

    @property
    def max_prompt_bytes(self) -> int:
        """A prompt of more UTF-8 bytes than this cannot fit the context (see Tokenizer.max_text_bytes)."""
        return self.tokenizer.max_text_bytes(self.max_context)

    def encode_prompt(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of the prompt. A prompt that cannot fit the context is refused before the whole
        of it is tokenized."""
        if chat:
            head = [{"role": "system", "content": system}] if system is not None else []
            return self.tokenizer.encode_chat([*head, {"role": "user", "content": prompt}],
                                              max_tokens=self.max_context)
        return self.tokenizer.encode(prompt, max_tokens=self.max_context)

    def generate(self, prompt: str, params: SamplingParams = SamplingParams(), chat: bool = False,
                 system: str | None = None) -> Iterator[str]:
        """Yield the generated text (not the prompt) piece by piece; self.stats is filled as it goes, and
        with params.logprobs, self.logprobs gets each generated token's TokenLogprobs.
        With chat, the prompt is one user message (after `system`, if given) in the chat template."""
        t0 = time.perf_counter()
        ids = self.encode_prompt(prompt, chat, system)
        if not ids:
            raise GDecodeError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise GDecodeError(
                f"the prompt is {len(ids)} tokens but the context holds {self.max_context} "
                "(raise --max-context or shorten the prompt)")
        budget = min(params.max_new_tokens, self.max_context - len(ids))
        if params.seed is None:
            params = replace(params, seed=secrets.randbits(63))
        self.stats = stats = GenerationStats(prompt_tokens=len(ids), stop_reason="length")
        self.logprobs = []
        decoder = StreamDecoder(self.tokenizer, context=ids)
        stops = StopMatcher(params.stop)
        eos = self.tokenizer.eos_ids
        tokens = self.backend.generate(ids, params, budget)
        t_first = None
        try:
            for token in tokens:
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                    stats.ttft = now - t0
                stats.new_tokens += 1
                stats.seconds = now - t_first
                if params.logprobs is not None:
                    self.logprobs.append(self.backend.token_logprobs)
                if token in eos:
                    stats.stop_reason = "eos"
                    break
                text, hit = stops.push(decoder.push(token))
                if text:
                    yield text
                if hit:
                    stats.stop_reason = "stop"
                    break
            else:
                if budget < params.max_new_tokens:
                    stats.stop_reason = "context"
            if stats.stop_reason != "stop":
                text, _ = stops.push(decoder.flush(), final=True)
                if text:
                    yield text
        finally:
            tokens.close()


def _check_host_memory(cfg: ModelConfig, max_context: int) -> None:
    """The numpy backend's float32 KV cache must fit the host's available memory."""
    need = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * max_context * 4
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if need > avail:
        raise GDecodeError(f"the numpy backend's float32 KV cache for {max_context} positions needs "
                           f"{need / 2**30:.1f} GiB but {avail / 2**30:.1f} GiB of memory is available: "
                           "lower --max-context")


class StopMatcher:
    """Holds back text that could be the start of a stop string; reports when one appears."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        if final:
            out, self.pending = self.pending, ""
            return out, False
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False
