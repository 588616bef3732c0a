"""The latency-first engine: a few streams at a time, each token out the step it is sampled.

A step is one batched decode pass over every stream that has finished its prefill, then as
much prompt prefill as the rest of the step budget allows, earliest deadline first. A long
prompt therefore enters in chunks between decode passes instead of freezing the streams
already running, and a new request starts its prefill in the first step that has room.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engines.base import EngineLoad, EngineRequest, StepOutput
from engines.runtime.detokenizer import OutputTracker
from engines.runtime.loader import LoadedModel
from engines.runtime.sampling import make_generator, sample
from engines.stream.kv import DecodeBatch, GrowingCache, cache_argument, cache_bytes, cache_length, new_cache
from engines.stream.schedule import EdfQueue, Ewma, PrefillCost
from slogate.protocol import FinishReason

_WARMUP_TOKENS = 256


@dataclass
class _Stream:
    request: EngineRequest
    prompt_ids: list[int]
    tracker: OutputTracker
    generator: torch.Generator | None
    cache: GrowingCache | None = None
    prefilled: int = 0

    def output(
        self, text: str = "", tokens: list[int] | None = None, reason: FinishReason | None = None
    ) -> StepOutput:
        return StepOutput(
            request_id=self.request.id,
            text=text,
            token_ids=tokens or [],
            finish_reason=reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.tracker.token_ids),
        )


class StreamEngine:
    name = "stream"

    def __init__(
        self,
        loaded: LoadedModel,
        max_batch: int = 16,
        step_budget_ms: float = 20.0,
        prefill_chunk_tokens: int | None = None,
        min_prefill_chunk: int = 16,
        min_prefill_tokens: int = 512,
        max_prefill_chunk: int = 1024,
        enforce_deadline: bool = False,
        warmup: bool = True,
    ) -> None:
        """``prefill_chunk_tokens`` fixes the prompt tokens per step instead of sizing them
        from measured cost. ``enforce_deadline`` ends requests whose deadline has passed with
        finish reason ``deadline``; it is off by default because the worker already sweeps
        expired requests and answers them, and one place should decide how.
        ``min_prefill_tokens`` is the prompt work every step does even when decoding filled the
        budget: time to first token is the interactive objective, so a burst of short prompts
        must not be let in one per step while the estimate says the step is full."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.loaded = loaded
        self.model_id = loaded.model_id
        self.max_context = loaded.max_context
        self.max_batch = max_batch
        self.budget_s = step_budget_ms / 1000.0
        self.fixed_chunk = prefill_chunk_tokens
        self.min_chunk = min_prefill_chunk
        self.min_prefill_tokens = min_prefill_tokens
        self.max_chunk = max_prefill_chunk
        self.enforce_deadline = enforce_deadline
        self.prefill_cost = PrefillCost(0.0, 0.0, 0.0)
        self.decode_step_s = Ewma()
        self._streams: dict[str, _Stream] = {}
        self._waiting = EdfQueue()
        self._prefilling: list[str] = []
        self._batch = DecodeBatch(loaded.device)
        self._rejected: list[StepOutput] = []
        self._cache_arg = cache_argument(loaded.model)
        self._kv_held = (0, 0)
        if warmup:
            self._warmup()

    def add_request(self, request: EngineRequest) -> None:
        if request.id in self._streams:
            raise ValueError(f"request {request.id} is already in the engine")
        params = request.sampling
        try:
            prompt_ids = self.loaded.encode(request.prompt, request.messages)
        except Exception as exc:  # a template or tokenizer failure is this request's fault
            self._reject(request.id, f"cannot tokenize the request: {exc}", 0)
            return
        n = len(prompt_ids)
        if n == 0:
            self._reject(request.id, "the prompt is empty", 0)
        elif params.max_tokens < 1:
            self._reject(request.id, f"max_tokens must be at least 1, got {params.max_tokens}", n)
        elif n + params.max_tokens > self.max_context:
            self._reject(
                request.id,
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: "
                f"{n + params.max_tokens} exceeds the model's context of {self.max_context} tokens",
                n,
            )
        else:
            tracker = OutputTracker(self.loaded.tokenizer, params, self.loaded.eos_token_ids, prompt_ids)
            generator = make_generator(params, self.loaded.device)
            self._streams[request.id] = _Stream(request, prompt_ids, tracker, generator)
            self._waiting.push(request.id, request.deadline)

    def abort_request(self, request_id: str) -> None:
        self._rejected = [o for o in self._rejected if o.request_id != request_id]
        if self._streams.pop(request_id, None) is None:
            return
        self._waiting.remove(request_id)
        if request_id in self._prefilling:
            self._prefilling.remove(request_id)
        with torch.inference_mode():
            self._batch.leave({request_id})
        self._note_kv()

    def has_unfinished(self) -> bool:
        return bool(self._streams or self._rejected)

    def step(self) -> list[StepOutput]:
        outputs, self._rejected = self._rejected, []
        if self.enforce_deadline:
            outputs += self._expire(time.time())
        self._admit()
        started = time.perf_counter()
        with torch.inference_mode():
            if len(self._batch):
                outputs += self._decode()
            if self._prefilling:
                left = self.budget_s - (time.perf_counter() - started)
                outputs += self._prefill(left)
        self._note_kv()
        return outputs

    def load(self) -> EngineLoad:
        """Safe to call while ``step`` runs in another thread (the worker's heartbeat does):
        it reads counts and the KV figures noted at the end of the last step, never the
        structures a step is changing."""
        kv_tokens, kv_bytes = self._kv_held
        return EngineLoad(
            running=len(self._prefilling) + len(self._batch),
            waiting=len(self._waiting),
            capacity=self.max_batch,
            kv_usage=kv_tokens / (self.max_batch * self.max_context),
            prefill_s_per_token=self.prefill_cost.observed_per_token_s.value,
            decode_step_s=self.decode_step_s.value,
            extra={
                "kv_bytes": float(kv_bytes),
                "prefill_fixed_s": self.prefill_cost.fixed_s,
                "prefill_chunk_tokens": float(self._chunk_tokens(self.budget_s, 0)),
            },
        )

    def kv_tokens(self, request_id: str) -> int:
        """KV positions the request holds now (0 once it finished or was aborted)."""
        stream = self._streams.get(request_id)
        if stream is not None and stream.cache is not None:
            return cache_length(stream.cache)
        return self._batch.tokens_of(request_id)

    def kv_bytes(self) -> int:
        caches = (self._streams[rid].cache for rid in self._prefilling)
        return sum(cache_bytes(c) for c in caches if c is not None) + self._batch.nbytes()

    def _note_kv(self) -> None:
        self._kv_held = (sum(self.kv_tokens(rid) for rid in self._streams), self.kv_bytes())

    def _reject(self, request_id: str, message: str, prompt_tokens: int) -> None:
        self._rejected.append(
            StepOutput(
                request_id, finish_reason="error", prompt_tokens=prompt_tokens, error=message, error_status=400
            )
        )

    def _expire(self, now: float) -> list[StepOutput]:
        late = [s for s in self._streams.values() if s.request.deadline < now]
        outputs = [s.output(s.tracker.flush(), reason="deadline") for s in late]
        for stream in late:
            self.abort_request(stream.request.id)
        return outputs

    def _admit(self) -> None:
        while len(self._prefilling) + len(self._batch) < self.max_batch:
            request_id = self._waiting.pop()
            if request_id is None:
                break
            self._prefilling.append(request_id)
        self._prefilling.sort(key=lambda rid: self._streams[rid].request.deadline)

    def _chunk_tokens(self, left_s: float, start: int) -> int:
        if self.fixed_chunk is not None:
            return self.fixed_chunk
        return self.prefill_cost.tokens_within(left_s, start, self.min_chunk, self.max_chunk)

    def _fits_whole(self, rows: int, width: int, left_s: float) -> bool:
        if self.fixed_chunk is not None:
            return rows * width <= self.fixed_chunk
        if width > self.max_chunk:
            return False
        return rows * width <= self.min_prefill_tokens or self.prefill_cost.predict(rows, width) <= left_s

    def _prefill(self, left_s: float) -> list[StepOutput]:
        """Spend what is left of the step on prompts, earliest deadline first.

        Leading prompts that fit whole go through one padded forward pass together, which
        keeps the first token of a burst of short requests cheap. Otherwise the first prompt
        gets the biggest chunk that fits, and always at least a small one.
        """
        group: list[_Stream] = []
        width = 0
        for request_id in self._prefilling:
            stream = self._streams[request_id]
            widest = max(width, len(stream.prompt_ids))
            if stream.prefilled > 0 or not self._fits_whole(len(group) + 1, widest, left_s):
                break
            group.append(stream)
            width = widest
        if group:
            return self._prefill_whole(group)
        stream = self._streams[self._prefilling[0]]
        start = stream.prefilled
        n = min(self._chunk_tokens(left_s, start), len(stream.prompt_ids) - start)
        try:
            logits = self._prefill_chunk(stream, n)
        except Exception as exc:  # one request's failure must not take the engine down
            return [self._fail(stream, exc)]
        if logits is None:
            return []
        cache, stream.cache = stream.cache, None
        mask = torch.ones(1, len(stream.prompt_ids), dtype=torch.long, device=self.loaded.device)
        return self._start_decoding([stream], logits, cache, mask)

    def _prefill_whole(self, group: list[_Stream]) -> list[StepOutput]:
        began = time.perf_counter()
        try:
            logits, cache, mask = self._forward_prompts(group)
        except Exception as exc:  # find the request at fault: alone, it fails only itself
            if len(group) == 1:
                return [self._fail(group[0], exc)]
            return [o for stream in group for o in self._prefill_whole([stream])]
        rows, width = mask.shape
        if rows * width >= self.min_chunk:
            self.prefill_cost.add(rows, width, 0, time.perf_counter() - began)
        return self._start_decoding(group, logits, cache, mask)

    def _forward_prompts(self, group: list[_Stream]) -> tuple[torch.Tensor, GrowingCache, torch.Tensor]:
        """One forward pass over whole prompts, left-padded so every row ends at its last
        prompt token."""
        device = self.loaded.device
        width = max(len(s.prompt_ids) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(group), width, dtype=torch.long, device=device)
        for row, stream in enumerate(group):
            n = len(stream.prompt_ids)
            ids[row, width - n :] = torch.tensor(stream.prompt_ids, device=device)
            mask[row, width - n :] = 1
        cache = new_cache()
        padded = not bool(mask.all())
        out = self.loaded.model(
            input_ids=ids,
            attention_mask=mask if padded else None,
            position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
            **{self._cache_arg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self._sync()
        for stream in group:
            stream.prefilled = len(stream.prompt_ids)
        return out.logits[:, -1, :], cache, mask

    def _start_decoding(
        self, streams: list[_Stream], logits: torch.Tensor, cache: GrowingCache, mask: torch.Tensor
    ) -> list[StepOutput]:
        """Sample the first tokens from the prompts' last logits; the requests that go on
        join the decode batch."""
        tokens = sample(
            logits,
            [s.tracker.params for s in streams],
            [s.generator for s in streams],
            [[] for _ in streams],
            self.loaded.eos_token_ids,
        )
        outputs, finished = [], set()
        for stream, token in zip(streams, tokens):
            self._prefilling.remove(stream.request.id)
            text, reason = stream.tracker.append(token)
            outputs.append(stream.output(text, [token], reason))
            if reason is not None:
                finished.add(stream.request.id)
                del self._streams[stream.request.id]
        self._batch.join([s.request.id for s in streams], cache, mask, tokens)
        self._batch.leave(finished)
        return outputs

    def _prefill_chunk(self, stream: _Stream, n: int) -> torch.Tensor | None:
        """Run ``n`` more prompt tokens, learning what they cost; return the last position's
        logits once the prompt is done."""
        start = stream.prefilled
        if stream.cache is None:
            stream.cache = new_cache()
        began = time.perf_counter()
        logits = self._forward_chunk(stream.prompt_ids[start : start + n], start, stream.cache)
        if n >= self.min_chunk:
            self.prefill_cost.add(1, n, start, time.perf_counter() - began)
        stream.prefilled += n
        return logits if stream.prefilled == len(stream.prompt_ids) else None

    def _forward_chunk(self, ids: list[int], start: int, cache: GrowingCache) -> torch.Tensor:
        device = self.loaded.device
        out = self.loaded.model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.arange(start, start + len(ids), device=device).unsqueeze(0),
            **{self._cache_arg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self._sync()
        return out.logits[:, -1, :]

    def _decode(self) -> list[StepOutput]:
        began = time.perf_counter()
        streams = [self._streams[rid] for rid in self._batch.ids]
        try:
            inputs = self._batch.forward_inputs(self._cache_arg)
            out = self.loaded.model(**inputs, use_cache=True, logits_to_keep=1)
            tokens = sample(
                out.logits[:, -1, :],
                [s.tracker.params for s in streams],
                [s.generator for s in streams],
                [s.tracker.token_ids for s in streams],
                self.loaded.eos_token_ids,
            )
        except Exception as exc:  # the batch's cache is in an unknown state: end its rows
            outputs = [self._fail(s, exc) for s in streams]
            self._batch.leave({s.request.id for s in streams})
            return outputs
        self._batch.advance(tokens)
        outputs, finished = [], set()
        for stream, token in zip(streams, tokens):
            text, reason = stream.tracker.append(token)
            outputs.append(stream.output(text, [token], reason))
            if reason is not None:
                finished.add(stream.request.id)
                del self._streams[stream.request.id]
        self._batch.leave(finished)
        self.decode_step_s.add(time.perf_counter() - began)
        return outputs

    def _fail(self, stream: _Stream, exc: Exception) -> StepOutput:
        request_id = stream.request.id
        self._streams.pop(request_id, None)
        if request_id in self._prefilling:
            self._prefilling.remove(request_id)
        out = stream.output(reason="error")
        out.error = f"generation failed: {type(exc).__name__}: {exc}"
        out.error_status = 500
        return out

    def _sync(self) -> None:
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)

    def _warmup(self) -> None:
        """Measure what prefill costs before the first request, so the first long prompt is
        already chunked to fit the budget: a one-token pass gives the fixed cost, and passes
        at the start and deep in the context the cost per token and its growth with
        position. The fastest of a few runs filters out a busy host."""
        n = min(_WARMUP_TOKENS, self.max_context // 4)
        far = min(4 * n, self.max_context - n)
        vocab = self.loaded.model.config.get_text_config().vocab_size
        ids = [i % vocab for i in range(far + n)]
        best = {"fixed": float("inf"), "near": float("inf"), "far": float("inf")}
        with torch.inference_mode():
            for _ in range(3):
                for key, start, length in (("fixed", 0, 1), ("near", 0, n), ("far", far, n)):
                    cache = new_cache()
                    if start:
                        self._forward_chunk(ids[:start], 0, cache)
                    began = time.perf_counter()
                    self._forward_chunk(ids[start : start + length], start, cache)
                    best[key] = min(best[key], time.perf_counter() - began)
        self.prefill_cost = PrefillCost.fit(best["fixed"], n, best["near"], far, best["far"])
        self.decode_step_s = Ewma(best["fixed"])
