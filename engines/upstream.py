"""An engine that forwards each request to an OpenAI-compatible server (vLLM, TGI, SGLang,
another slogate) and streams its answer back.

Why: a team that already runs a vLLM or TGI fleet gets the gateway's admission control,
classes, rate limits and Redis-backed recovery in front of it without moving its models into
our engines. The server keeps its own batching; this engine only bounds how many requests it
has in flight there (``max_batch``) and reports the server's gap between chunks as its decode
step, so that the admission controller prices the upstream like any other pool.

The HTTP streams run on an event loop of the engine's own thread; the worker's engine loop
only sees what they queued, in :meth:`UpstreamEngine.step`. Features the server speaks in
another shape than our engines (tool calls, which it returns already parsed) are refused with a
400 naming the parameter, not answered wrongly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import uvloop

from engines.base import COUNT, NOT_NEGATIVE, EngineLoad, EngineRequest, Send, StepOutput, checked_options
from slogate.config import served_model_id
from slogate.protocol import TokenLogprob

log = logging.getLogger("slogate.upstream")

WAIT_SLICE_S = 0.002
"""How long a step waits on the server at a time before it looks for new requests again."""
STEP_WAIT_S = 0.05
"""The longest a step waits for the server: the engine loop applies cancels between steps."""
SMOOTHING = 0.2
"""Weight of the newest gap in the running average of the server's gap between chunks."""


@dataclass
class UpstreamOptions:
    url: str = ""
    """The server's OpenAI base URL, ``/v1`` included (``http://vllm:8000/v1``)."""
    upstream_model: str | None = None
    """The model's name at the server; default: the worker's ``--model``."""
    api_key: str | None = None
    """Sent as a bearer token; default: none. In a config file; on a command line, where ``ps``
    shows it to everyone on the host, name a variable with ``api_key_env`` instead."""
    api_key_env: str | None = None
    """The environment variable that holds ``api_key``."""
    max_batch: COUNT = 64
    """Requests in flight at the server at once; the rest wait here, in order."""
    max_context: int | None = None
    """The model's context in tokens; default: the ``max_model_len`` the server's
    ``/v1/models`` lists (vLLM, SGLang and slogate list it)."""
    connect_timeout_s: NOT_NEGATIVE = 5.0
    continuous_usage: bool = False
    """Ask for the running usage on every chunk (vLLM's ``continuous_usage_stats``): token
    counts as they come. Off, a chunk counts one token until the final usage corrects it."""


@dataclass
class _Seq:
    req: EngineRequest
    future: Future[None] | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    last_text_at: float = 0.0


@dataclass
class _Event:
    """What a stream queued for the engine loop; ``final`` on its last."""

    request_id: str
    text: str = ""
    at: float = 0.0
    """When it came (monotonic), for the gap between chunks: the engine loop reads several at once."""
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    usage: tuple[int, int] | None = None
    final: bool = False
    finish_reason: str | None = None
    error: tuple[int, str, str | None, str | None] | None = None
    """(status, message, code, param) of a request the server refused or could not serve."""


def request_body(req: EngineRequest, model: str, continuous_usage: bool = False) -> dict[str, Any]:
    """The server's request for ``req``: OpenAI's fields, and vLLM's extensions only where the
    request sets them (a plain OpenAI server refuses unknown fields). A ``max_tokens`` the client
    did not set is left out: the gateway's default is a cap, and the server, which knows the
    prompt's length, would refuse one that the prompt leaves no room for, where the gateway
    lowers it (:func:`slogate.protocol.fit_to_context`)."""
    s = req.sampling
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True,
                                               **({"continuous_usage_stats": True} if continuous_usage else {})},
                            "temperature": s.temperature, "top_p": s.top_p}
    if not s.max_tokens_default:  # the gateway's default is a cap this engine holds (UpstreamEngine._apply)
        body["max_tokens"] = s.max_tokens
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt or ""
    optional = {"stop": s.stop, "seed": s.seed, "presence_penalty": s.presence_penalty or None,
                "frequency_penalty": s.frequency_penalty or None, "top_k": s.top_k or None,
                "min_tokens": s.min_tokens or None, "ignore_eos": s.ignore_eos or None,
                "stop_token_ids": s.stop_token_ids,
                "logit_bias": {str(k): v for k, v in s.logit_bias.items()}}
    body.update({key: value for key, value in optional.items() if value not in (None, [], {})})
    if s.logprobs is not None:
        if req.messages is not None:
            body.update(logprobs=True, top_logprobs=s.logprobs)
        else:
            body["logprobs"] = s.logprobs
    if s.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "response", "schema": json.loads(s.json_schema)}}
    return body


def refused(req: EngineRequest) -> StepOutput | None:
    """A 400 for what the server would answer in another shape than the gateway expects."""
    if req.tools or req.sampling.schema_param is not None:
        return StepOutput(req.id, error_status=400, error_param="tools",
                          error="the upstream engine does not pass tools on: the server parses its own tool calls; "
                                "serve this model with a stream or paged engine for tool calls")
    return None


def chunk_event(request_id: str, chunk: dict[str, Any], chat: bool, counted: bool) -> _Event:
    """One SSE chunk as an event (the finish reason and usage are kept for the stream's end)."""
    event = _Event(request_id)
    if usage := chunk.get("usage"):
        event.usage = (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
    for choice in chunk.get("choices") or ():
        if chat:
            event.text += (choice.get("delta") or {}).get("content") or ""
            event.logprobs += [_chat_logprob(entry) for entry in (choice.get("logprobs") or {}).get("content") or ()]
        else:
            event.text += choice.get("text") or ""
            event.logprobs += _completion_logprobs(choice.get("logprobs"))
        event.finish_reason = choice.get("finish_reason") or event.finish_reason
    if not counted and (event.text or event.logprobs):
        event.tokens = max(1, len(event.logprobs))
    return event


def _chat_logprob(entry: dict[str, Any]) -> TokenLogprob:
    def raw(item: dict[str, Any]) -> bytes:
        return bytes(item["bytes"]) if item.get("bytes") is not None else str(item["token"]).encode()

    top = [(str(t["token"]), raw(t), float(t["logprob"])) for t in entry.get("top_logprobs") or ()]
    return TokenLogprob(str(entry["token"]), raw(entry), float(entry["logprob"]), top)


def _completion_logprobs(logprobs: dict[str, Any] | None) -> list[TokenLogprob]:
    if not logprobs:
        return []
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs.get("tokens") or ())
    return [TokenLogprob(token, token.encode(), float(lp),
                         [(t, t.encode(), float(v)) for t, v in (top or {}).items()])
            for token, lp, top in zip(logprobs.get("tokens") or (), logprobs.get("token_logprobs") or (), tops)]


def error_of(status: int, body: bytes) -> tuple[int, str, str | None, str | None]:
    """The server's refusal as ours: the client's fault stays a 400 with the server's words, the
    rest (the worker's credentials, URL or model refused, the server overloaded or failing) is
    the gateway's 502 or 503."""
    try:
        err = json.loads(body)["error"]
        message, code, param = str(err.get("message") or err), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code, param = body.decode(errors="replace")[:500] or f"HTTP {status}", None, None
    if status in (401, 403, 404):  # the worker's configuration, not the client's request
        why = f"the upstream server refused the worker's credentials, URL or model ({status}): {message}"
        return 502, why, "upstream_error", None
    if status in (429, 503):
        return 503, f"the upstream server is overloaded ({status}): {message}", "upstream_overloaded", None
    if 400 <= status < 500:
        return 400, message, code if isinstance(code, str) else None, param
    return 502, f"the upstream server failed ({status})", "upstream_error", None  # its words go to the log


class UpstreamEngine:
    name = "upstream"

    def __init__(self, model_id: str, opts: UpstreamOptions, max_context: int) -> None:
        self.model_id = model_id
        self.max_context = max_context
        self.opts = opts
        self._model = opts.upstream_model or model_id
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._errors: list[StepOutput] = []
        self._events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self._gap_s = 0.0
        self._unreachable = False
        """Whether the server's last call failed (read and written on the HTTP thread only)."""
        self._loop = uvloop.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="upstream-http", daemon=True).start()
        self._session: aiohttp.ClientSession = asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()

    async def _open(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers=_auth(self.opts), timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=self.opts.connect_timeout_s), connector=aiohttp.TCPConnector(limit=0))

    def prepare(self, request: EngineRequest) -> EngineRequest:
        return request

    def add_request(self, request: EngineRequest) -> None:
        if (out := refused(request)) is not None:
            self._errors.append(out)
            return
        self._waiting.append(_Seq(request))

    def abort_request(self, request_id: str) -> None:
        self._waiting = deque(s for s in self._waiting if s.req.id != request_id)
        seq = self._running.pop(request_id, None)
        if seq is not None and seq.future is not None:
            seq.future.cancel()  # closes its response: the server stops generating

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._errors)

    def step(self, arrivals: Callable[[], bool] | None = None, send: Send | None = None) -> list[StepOutput]:
        """Start what fits, then hand on what the server sent: everything queued, after waiting
        up to ``STEP_WAIT_S`` for the first of it, looking for new requests meanwhile."""
        outputs = self._admit()
        events: list[_Event] = []
        end = time.monotonic() + STEP_WAIT_S
        while not events and self._running and time.monotonic() < end:
            try:
                events.append(self._events.get(timeout=WAIT_SLICE_S))
            except queue.Empty:
                if arrivals is not None and arrivals():
                    outputs += self._admit()
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        return outputs + [out for event in events if (out := self._apply(event)) is not None]

    def _admit(self) -> list[StepOutput]:
        """Send the waiting requests that fit to the server; the refused ones' outputs."""
        while self._waiting and len(self._running) < self.opts.max_batch:
            seq = self._waiting.popleft()
            seq.future = asyncio.run_coroutine_threadsafe(self._stream(seq.req), self._loop)
            self._running[seq.req.id] = seq
        errors, self._errors = self._errors, []
        return errors

    def _apply(self, event: _Event) -> StepOutput | None:
        seq = self._running.get(event.request_id)
        if seq is None:  # aborted meanwhile
            return None
        if event.text:
            if seq.last_text_at:
                self._gap_s += SMOOTHING * ((event.at - seq.last_text_at) - self._gap_s)
            seq.last_text_at = event.at
        seq.completion_tokens += event.tokens
        if event.usage is not None:
            seq.prompt_tokens, completion = event.usage
            seq.completion_tokens = completion or seq.completion_tokens
        out = StepOutput(event.request_id, text=event.text, logprobs=event.logprobs,
                         prompt_tokens=seq.prompt_tokens, completion_tokens=seq.completion_tokens)
        if event.error is not None:
            out.error_status, out.error, out.error_code, out.error_param = event.error
        elif event.final:
            out.finish_reason = "length" if event.finish_reason == "length" else "stop"
        elif seq.req.sampling.max_tokens_default and seq.completion_tokens >= seq.req.sampling.max_tokens:
            out.finish_reason = "length"  # the gateway's cap, which the server was not told
            out.completion_tokens = seq.req.sampling.max_tokens
            if seq.future is not None:
                seq.future.cancel()
        elif not (event.text or event.logprobs):
            return None
        if out.finish_reason is not None or out.error is not None:
            del self._running[event.request_id]
        return out

    async def _stream(self, req: EngineRequest) -> None:
        chat = req.messages is not None
        url = f"{self.opts.url.rstrip('/')}/{'chat/completions' if chat else 'completions'}"
        body = request_body(req, self._model, self.opts.continuous_usage)
        finish: str | None = None
        usage: tuple[int, int] | None = None
        put = self._events.put
        try:
            timeout = aiohttp.ClientTimeout(total=max(req.deadline - time.time(), 0.001),
                                            sock_connect=self.opts.connect_timeout_s)
            async with self._session.post(url, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    refusal = await resp.read()
                    if resp.status >= 500:
                        log.warning("the upstream server answered %d: %s", resp.status, refusal[:500])
                    put(_Event(req.id, error=error_of(resp.status, refusal)))
                    return
                async for line in resp.content:
                    data = line.strip()
                    if not data.startswith(b"data:"):
                        continue
                    data = data[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        log.warning("the upstream server failed a stream: %s", str(chunk["error"])[:500])
                        put(_Event(req.id, error=(502, "the upstream server failed in the middle of the answer",
                                                  "upstream_error", None)))
                        return
                    event = chunk_event(req.id, chunk, chat, self.opts.continuous_usage)
                    event.at = time.monotonic()
                    finish, usage = event.finish_reason or finish, event.usage or usage
                    if event.text or event.logprobs or event.usage:
                        put(event)
            if finish is None:
                put(_Event(req.id, error=(502, "the upstream server ended the stream before the answer did",
                                          "upstream_error", None)))
                return
            put(_Event(req.id, usage=usage, final=True, finish_reason=finish))
            if self._unreachable:
                self._unreachable = False
                log.info("the upstream server at %s answers again", self.opts.url)
        except TimeoutError as exc:
            late = time.time() >= req.deadline
            put(_Event(req.id, error=(504, "the request's deadline passed at the upstream server", "deadline_exceeded",
                                      None)) if late else self._failed(req.id, exc))
        except Exception as exc:  # unreachable, or not OpenAI's stream: the request must end, not hang
            put(self._failed(req.id, exc))

    def _failed(self, request_id: str, exc: Exception) -> _Event:
        """The client is told the server failed; the server's address and what failed go to the
        worker's log (once, until it answers again), not to clients."""
        if not self._unreachable:
            self._unreachable = True
            log.warning("the upstream server at %s could not be reached or sent what is not OpenAI's stream: %s",
                        self.opts.url, str(exc) or type(exc).__name__)
        return _Event(request_id, error=(502, "the upstream server could not be reached or sent what is not an "
                                              "OpenAI stream", "upstream_error", None))

    def load(self) -> EngineLoad:
        """No prompt cost of its own: how a server's first token splits into its queue, its prompt
        and the hops is not to be seen from here, so the gateway prices first tokens by what it
        learns from the answers. The gap between chunks is the server's decode step."""
        return EngineLoad(running=len(self._running), waiting=len(self._waiting), capacity=self.opts.max_batch,
                          decode_step_s=self._gap_s)


def _auth(opts: UpstreamOptions) -> dict[str, str]:
    return {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}


def _listed_context(opts: UpstreamOptions, model: str) -> int:
    """The model's context as the server's ``/v1/models`` lists it."""
    async def fetch() -> Any:
        timeout = aiohttp.ClientTimeout(total=opts.connect_timeout_s + 5, sock_connect=opts.connect_timeout_s)
        async with aiohttp.ClientSession(headers=_auth(opts), timeout=timeout) as session:
            async with session.get(f"{opts.url.rstrip('/')}/models") as resp:
                resp.raise_for_status()
                return await resp.json()

    try:
        listed = asyncio.run(fetch())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ValueError(f"upstream engine: cannot read {opts.url}/models ({exc}); is the server up? "
                         "Or set -o max_context=N") from None
    for entry in listed.get("data") or ():
        if entry.get("id") == model and isinstance(entry.get("max_model_len"), int):
            return entry["max_model_len"]
    raise ValueError(f"upstream engine: {opts.url}/models lists no max_model_len for {model!r}; set -o max_context=N")


OPTIONS = UpstreamOptions


def create(model: str | None = None, **options: Any) -> UpstreamEngine:
    """Options are checked, and the server asked for the model's context, before the worker
    serves anything: a wrong URL stops the worker at start with its reason."""
    opts = checked_options("upstream", UpstreamOptions, options)
    if not opts.url.startswith(("http://", "https://")):
        raise ValueError("upstream engine: -o url=http://HOST:PORT/v1 (the server's OpenAI base URL) is required")
    if not model:
        raise ValueError("the upstream engine needs --model: the name it serves under (and asks the server for)")
    if opts.api_key_env:
        if not os.environ.get(opts.api_key_env):
            raise ValueError(f"upstream engine: api_key_env names {opts.api_key_env}, which is not set")
        opts.api_key = os.environ[opts.api_key_env]
    model_id = served_model_id(model)
    max_context = opts.max_context or _listed_context(opts, opts.upstream_model or model_id)
    return UpstreamEngine(model_id, opts, max_context)
