"""An OpenAI-compatible chat-completions server on the policy's sampler, recording token-exact episodes.

Agent scaffolds (smolagents, mini-swe-agent, OpenHands, …) own their episode loop and call a model
through `POST /v1/chat/completions`. `ChatServer` answers those calls from the policy being trained and
keeps, per episode, the token ids it rendered and sampled, so the rollout of a scaffold becomes a
`Trajectory` exactly as the agent loop's are (`sao_jax.rollout.scaffold` runs the episodes).

Pieces
------
`GenerationEngine`  continuous batching of completion requests over one `Sampler`: a thread owns the
                    KV cache of `num_slots` rows; a request takes a free row, is prefilled and decoded
                    chunk by chunk beside the others, and frees its row when it stops. Each request
                    reads the weights once, when it is admitted (`(params, version)` of its episode's
                    weight source), and finishes on them: rows of different versions are prefilled and
                    decoded by separate sampler calls (the sampler's rows are independent), and every
                    token records the version that sampled it. A request's prompt is prefilled whole:
                    a row is not kept for an episode between its requests (a scaffold may never come
                    back), so each turn re-reads the conversation so far.
`ChatServer`        FastAPI + uvicorn on a loopback address only (127.0.0.1 by default, a free port);
                    `open_episode(id, …)` / `close_episode(id) -> EpisodeRecord`.

The episode id is the API key: a scaffold is pointed at `base_url` with `api_key=<episode id>`, and
the request's `Authorization: Bearer <episode id>` names the episode (an id the server did not open is
refused, 401). Requests of one episode are served one at a time.

Token-exact records and re-tokenization drift
---------------------------------------------
Per episode the server keeps segments; a segment is one token sequence `prompt ‖ a_0 ‖ o_0 ‖ a_1 …`
and the text it decodes to. For each request:

  1. Assistant messages the server itself returned in this episode (same content, or the same after
     the scaffold stripped surrounding whitespace, and the same tool calls) are rendered from the exact
     text the policy generated: the scaffold's re-formatting of its tool calls or trimming of its
     content does not rewrite what the policy produced.
  2. The messages are rendered with the model's chat template (tools included when given),
     `add_generation_prompt=True`.
  3. If the rendering starts with the text of the episode's current segment (the last rendering and
     the last action's text, its stop token left out), the rest is an observation: its tokens
     (`tokenizer.encode` of that rest, less the action's stop token when the template ends the turn
     with that very token, as `ChatEnv` does) are appended, and the prompt is the segment's tokens as
     recorded (sampled tokens keep their ids and log μ; never re-tokenized). If it
     does not (the scaffold rewrote or truncated history, or the template renders history
     differently), a new segment starts from the tokens of the whole rendering, and the episode's
     `prefix_mismatches` and the server's `stats["prefix_mismatch"]` count it. Segments are never
     spliced: only a segment is a sequence the policy actually conditioned on.
  4. The completion (its token ids, log μ, entropy, version) is appended as an action; the text of
     the segment becomes the rendering plus the decoded action.

So within a segment the trajectory is the rendered conversation token for token, with the policy's
own tokens where it sampled them. Observations are tokenized apart from what precedes them, as
`ChatEnv` does: exact at the special tokens that end turns.

Requests
--------
Honoured: `messages` (roles system/developer, user, assistant (with `tool_calls`), tool; content a
string or a list of text parts), `max_tokens` / `max_completion_tokens` (capped by the server's
`max_action_tokens`, the episode's remaining token budget and the cache), `stop` (strings; the sampled
tokens up to the one that completes the stop string are kept, the content ends before it), `logprobs`,
`top_logprobs` (0-20), `tools`, `tool_choice` ("none" leaves the tools out; otherwise not enforced).
Ignored: `model`, `temperature`, `top_p`, `seed`, `user`, penalties, `parallel_tool_calls`: the
rollout's sampling settings apply, so log μ is always the distribution the sampler drew from.
Refused with an OpenAI-style error JSON (HTTP 400): `stream=true`, `n` ≠ 1, non-text content parts,
`logit_bias`, a `response_format` other than text, tools for a template that does not render them, a
prompt that leaves no room in the cache (`context_length_exceeded`), a request past the episode's token
budget (`token_budget_exceeded`, 400; the episode then fails). An episode the runner closed (done or
past its deadline) is no longer open: 401, or 410 for a request that was already waiting or running.

Response: the OpenAI `chat.completion` object; `logprobs.content[i]` for every sampled token (`logprob`
is the recorded log μ; `top_logprobs` come from one scoring forward under the same weights and
sampling transform, equal to the sampler's up to float rounding); tool calls parsed from Hermes-style
`<tool_call>{"name": …, "arguments": …}</tool_call>` blocks when the request has tools
(finish_reason "tool_calls"). An extra `sao` object carries the episode id, segment, policy version and
the prompt's and completion's token ids.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import ipaddress
import json
import logging
import math
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import fastapi
import jax
import jax.numpy as jnp
import numpy as np
import uvicorn
from fastapi.responses import JSONResponse
from flax import nnx

from sao_jax.rollout.sampler import Sampler

log = logging.getLogger(__name__)

MAX_STOP_IDS = 8  # width of the per-row stop-id table (one compiled decode shape)
MIN_PREFILL_WIDTH = 8  # prefill widths are powers of two from here
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
NO_PROBABILITY = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -inf)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def check_loopback(host: str) -> str:
    """`host` if it is a loopback address (127.0.0.0/8, ::1, "localhost"), else a ValueError: the
    server never listens where another machine could reach it."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"the chat server listens on loopback addresses only (127.0.0.0/8 or ::1), not {host!r}")
    return host


# --- generation: continuous batching over the sampler --------------------------------------------------------


@dataclasses.dataclass
class Completion:
    """What one request sampled. tokens/logprobs/entropy: [n] (the stop token included when one ended
    it); finish: "stop_token", "stop_string" or "length"; stop_at: for "stop_string", the character
    of decode(tokens) where the stop string starts."""

    tokens: np.ndarray
    logprobs: np.ndarray
    entropy: np.ndarray
    version: int
    params: Any
    finish: str
    stop_at: int | None = None


@dataclasses.dataclass(eq=False)
class _Request:
    prompt: np.ndarray
    max_new_tokens: int
    stop_ids: np.ndarray
    stop_strings: tuple[str, ...]
    key: jax.Array
    params: Any
    version: int
    future: concurrent.futures.Future
    prefilled: bool = False
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    entropy: list = dataclasses.field(default_factory=list)

    @property
    def sampled(self) -> int:
        return sum(len(t) for t in self.tokens)


class GenerationEngine:
    """Continuous batching of completion requests over `sampler` (module docstring): `num_slots` rows
    of `max_total_tokens` cache slots each. `decode(ids) -> text` finds stop strings. `submit` is
    thread-safe and returns a Future of a `Completion`. `stats` counts requests, prefills, decode_chunks."""

    def __init__(self, sampler: Sampler, decode: Callable[[Sequence[int]], str], *, num_slots: int,
                 max_total_tokens: int):  # fmt: skip
        self.sampler, self.decode = sampler, decode
        self.num_slots, self.max_total_tokens = num_slots, max_total_tokens
        self.stats: collections.Counter = collections.Counter()
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="generation-engine")
        self._thread.start()

    def submit(self, prompt: np.ndarray, *, max_new_tokens: int, stop_ids: Sequence[int], stop_strings=(),
               key: jax.Array, weights: tuple[Any, int]) -> concurrent.futures.Future:  # fmt: skip
        if self._failure is not None:
            raise RuntimeError("the generation engine has failed") from self._failure
        if self._closed:
            raise RuntimeError("the generation engine is closed")
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(stop_ids)} stop tokens, at most {MAX_STOP_IDS}")
        if not 0 < len(prompt) < self.max_total_tokens:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit max_total_tokens={self.max_total_tokens}")
        table = np.full(MAX_STOP_IDS, -1, np.int32)
        table[: len(stop_ids)] = stop_ids
        params, version = weights
        request = _Request(np.asarray(prompt, np.int32), max(1, int(max_new_tokens)), table, tuple(stop_strings), key,
                           params, int(version), concurrent.futures.Future())  # fmt: skip
        self._inbox.put(request)
        return request.future

    def close(self) -> None:
        """Stop the thread; requests not finished by then fail with RuntimeError."""
        self._closed = True
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        rows: list[_Request | None] = [None] * self.num_slots
        try:
            state = self.sampler.init_state(self.num_slots, self.max_total_tokens)
            while not self._closed:
                for b in range(self.num_slots):  # free rows take waiting requests; wait only when all are free
                    if rows[b] is not None:
                        continue
                    try:
                        request = self._inbox.get(block=all(r is None for r in rows))
                    except queue.Empty:
                        break
                    if request is None:  # close()
                        break
                    rows[b] = request
                    self.stats["requests"] += 1
                versions = sorted({r.version for r in rows if r is not None})
                for version in versions:
                    mine = [r if r is not None and r.version == version else None for r in rows]
                    state = self._step(state, mine)
                for b, request in enumerate(rows):
                    if request is not None and request.future.done():
                        rows[b] = None
        except BaseException as failure:  # noqa: BLE001 — a device error: every waiting caller gets it
            self._failure = failure
        self._fail_waiting(rows, self._failure or RuntimeError("the generation engine was closed"))

    def _fail_waiting(self, rows: list[_Request | None], error: BaseException) -> None:
        """Every request still in a row or in the inbox gets `error`: no caller waits forever."""
        waiting = [r for r in rows if r is not None]
        while True:
            try:
                waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for request in waiting:
            if request is not None and not request.future.done():
                request.future.set_exception(error)

    def _step(self, state, rows: list[_Request | None]):
        """Prefill the new rows of one version, then one decode chunk for its rows."""
        params = next(r.params for r in rows if r is not None)
        fresh = [r if r is not None and not r.prefilled else None for r in rows]
        if any(fresh):
            longest = max(len(r.prompt) for r in fresh if r is not None)
            width = min(max(MIN_PREFILL_WIDTH, 1 << (longest - 1).bit_length()), self.max_total_tokens)
            tokens = np.zeros((len(rows), width), np.int32)
            mask = np.zeros((len(rows), width), bool)
            for b, r in enumerate(fresh):
                if r is not None:
                    tokens[b, : len(r.prompt)], mask[b, : len(r.prompt)], r.prefilled = r.prompt, True, True
            state = self.sampler.prefill(params, state, tokens, mask, reset=mask.any(axis=1))
            self.stats["prefills"] += 1
        max_new = np.array([0 if r is None else min(r.max_new_tokens - r.sampled,
                                                     self.max_total_tokens - len(r.prompt) - r.sampled)
                            for r in rows], np.int32)  # fmt: skip
        stop_ids = np.stack([np.full(MAX_STOP_IDS, -1, np.int32) if r is None else r.stop_ids for r in rows])
        some_key = next(r.key for r in rows if r is not None)
        keys = jnp.stack([some_key if r is None else r.key for r in rows])
        longest = max(len(r.prompt) + r.sampled + min(int(m), self.sampler.chunk_size)
                      for r, m in zip(rows, max_new) if r is not None)  # fmt: skip
        state, chunk = self.sampler.decode_chunk(params, state, keys, max_new, stop_ids,
                                                 self.sampler.window_for(state, longest))  # fmt: skip
        chunk = jax.device_get(chunk)
        self.stats["decode_chunks"] += 1
        for b, r in enumerate(rows):
            if r is None or max_new[b] == 0:
                continue
            n = int(chunk.num_tokens[b])
            r.tokens.append(chunk.tokens[b, :n])
            r.logprobs.append(chunk.logprobs[b, :n])
            r.entropy.append(chunk.entropy[b, :n])
            stopped = self._stop_string(r)
            if stopped is not None:
                keep, at = stopped
                self._finish(r, "stop_string", keep=keep, stop_at=at)
            elif chunk.finished[b]:
                last = int(chunk.tokens[b, n - 1]) if n else -1
                self._finish(r, "stop_token" if n and last in r.stop_ids else "length")
        return state

    def _stop_string(self, r: _Request) -> tuple[int, int] | None:
        """(tokens to keep, character where the stop string starts) for the first stop string in the
        decoded completion: the tokens up to the one that completes it."""
        if not r.stop_strings:
            return None
        tokens = np.concatenate(r.tokens)
        text = self.decode(tokens)
        found = [(text.find(s), s) for s in r.stop_strings if s and s in text]
        if not found:
            return None
        at, stop = min(found)
        for keep in range(1, len(tokens) + 1):
            if len(self.decode(tokens[:keep])) >= at + len(stop):
                return keep, at
        return len(tokens), at

    def _finish(self, r: _Request, finish: str, *, keep: int | None = None, stop_at: int | None = None) -> None:
        tokens, logprobs, entropy = (np.concatenate(x)[:keep] for x in (r.tokens, r.logprobs, r.entropy))
        r.future.set_result(Completion(tokens.astype(np.int32), logprobs.astype(np.float32),
                                       entropy.astype(np.float32), r.version, r.params, finish, stop_at))  # fmt: skip


# --- episodes: token-exact records -----------------------------------------------------------------------------


@dataclasses.dataclass
class Segment:
    """One token sequence the policy conditioned on: parallel per-token lists, and its decoded text."""

    text: str = ""  # the rendering of the last request and the last action's text, its stop token left out
    stop_token_text: str = ""  # the stop token that ended the last action, if one did
    tokens: list = dataclasses.field(default_factory=list)
    action_mask: list = dataclasses.field(default_factory=list)
    rollout_logprobs: list = dataclasses.field(default_factory=list)
    rollout_entropy: list = dataclasses.field(default_factory=list)
    policy_version: list = dataclasses.field(default_factory=list)
    turn_index: list = dataclasses.field(default_factory=list)
    num_actions: int = 0
    unterminated_actions: int = 0
    last_action: str = ""

    def add_context(self, tokens: np.ndarray, turn: int) -> None:
        n = len(tokens)
        self._add(tokens, np.zeros(n, bool), np.zeros(n, np.float32), np.zeros(n, np.float32),
                  np.full(n, -1, np.int32), np.full(n, turn, np.int32))  # fmt: skip

    def add_action(self, completion: Completion) -> None:
        n = len(completion.tokens)
        self._add(completion.tokens, np.ones(n, bool), completion.logprobs, completion.entropy,
                  np.full(n, completion.version, np.int32), np.full(n, self.num_actions, np.int32))  # fmt: skip
        self.num_actions += 1
        self.unterminated_actions += completion.finish != "stop_token"

    def _add(self, *columns) -> None:
        names = ("tokens", "action_mask", "rollout_logprobs", "rollout_entropy", "policy_version", "turn_index")
        for name, column in zip(names, columns):
            getattr(self, name).append(np.asarray(column))

    def array(self, name: str) -> np.ndarray:
        parts = getattr(self, name)
        return np.concatenate(parts) if parts else np.zeros(0)

    @property
    def length(self) -> int:
        return sum(len(t) for t in self.tokens)


@dataclasses.dataclass(eq=False)
class EpisodeRecord:
    """Everything the server recorded for one episode. `segments`: in order, the last one current.
    `failure`: None, or (kind, message) when the server refused the episode a request it must fail
    for ("token_budget"). `truncated`: a request did not fit the cache (`context_length_exceeded`)."""

    episode_id: str
    key: jax.Array
    weights: Callable[[], tuple[Any, int]]
    token_budget: int
    segments: list[Segment] = dataclasses.field(default_factory=list)
    returned: dict = dataclasses.field(default_factory=dict)  # (content, tool calls) -> generated text
    requests: int = 0
    generated_tokens: int = 0
    prefix_mismatches: int = 0
    truncated: bool = False
    failure: tuple[str, str] | None = None
    closed: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `code` and `param`."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _arguments(value: Any) -> Any:
    """A tool call's arguments as templates expect them: a JSON string becomes its object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _tool_calls_key(tool_calls: Any) -> str:
    calls = [(c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
             for c in (tool_calls or []) if isinstance(c, Mapping)]  # fmt: skip
    return json.dumps(calls, sort_keys=True, default=str)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content outside the blocks, tool calls) of Hermes-style `<tool_call>{"name", "arguments"}</tool_call>`
    blocks; a block that is not such JSON stays in the content."""
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        kept.append(text[last: match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


class ChatServer:
    """The chat-completions endpoint over a `GenerationEngine` (module docstring).

    chat_format: the model's `ChatFormat` (`render`, `template`, `context`, `stop_strings`); tokenizer:
    `encode`, `decode`. max_action_tokens: most tokens one completion samples. `stats` counts requests,
    refused requests, prefix_mismatch. Start with `start()` (or `with ChatServer(...) as server:`);
    `base_url` is then `http://HOST:PORT/v1`.
    """

    def __init__(self, engine: GenerationEngine, tokenizer, chat_format, *, max_action_tokens: int,
                 host: str = "127.0.0.1", port: int = 0, model_name: str = "sao-policy"):  # fmt: skip
        self.engine, self.tokenizer, self.chat_format = engine, tokenizer, chat_format
        self.max_action_tokens, self.model_name = max_action_tokens, model_name
        self.host, self.port = check_loopback(host), port
        self.stats: collections.Counter = collections.Counter()
        self._episodes: dict[str, EpisodeRecord] = {}
        self._episodes_lock = threading.Lock()
        self._stop_ids = [int(i) for s in chat_format.stop_strings for i in tokenizer.encode(s)][:MAX_STOP_IDS]
        self._renders_tools = "tools" in chat_format.template.source
        self._score = jax.jit(self._score_impl, static_argnums=(3,))
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._make_app()

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> ChatServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="chat-server")  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the chat server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    # --- episodes -----------------------------------------------------------------------------------------

    def open_episode(self, episode_id: str, *, key: jax.Array, weights: Callable[[], tuple[Any, int]],
                     token_budget: int) -> None:  # fmt: skip
        """Start recording `episode_id`; its requests sample with fold_in(key, request index) and the
        weights `weights()` returns when each is admitted; at most `token_budget` tokens generated."""
        with self._episodes_lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} is already open")
            self._episodes[episode_id] = EpisodeRecord(episode_id, key, weights, token_budget)

    def close_episode(self, episode_id: str) -> EpisodeRecord:
        """Stop serving `episode_id` and hand its record over: later requests get 401 (no open episode),
        one waiting for its turn gets 410; a request being generated finishes first (its completion
        is recorded, its caller gets 410)."""
        with self._episodes_lock:
            record = self._episodes.pop(episode_id)
        record.closed = True
        with record.lock:
            return record

    # --- the endpoint -------------------------------------------------------------------------------------

    def _make_app(self) -> fastapi.FastAPI:
        app = fastapi.FastAPI(title="sao_jax policy", docs_url=None, redoc_url=None, openapi_url=None)

        @app.post("/v1/chat/completions")
        def chat_completions(body: dict[str, Any] = fastapi.Body(...),
                             authorization: str | None = fastapi.Header(default=None)):  # fmt: skip
            try:
                return self.complete(body, authorization)
            except RequestError as error:
                self.stats["refused"] += 1
                return error.response()

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "sao_jax"}]}

        @app.exception_handler(fastapi.exceptions.RequestValidationError)
        def invalid_body(request, error):
            return RequestError(400, f"the request body must be a JSON object: {error.errors()}").response()

        return app

    def complete(self, body: Mapping[str, Any], authorization: str | None) -> dict:
        """One chat completion (the endpoint's work; module docstring). Raises RequestError."""
        episode = self._episode_of(authorization)
        request = self._parse(body)
        with episode.lock:
            if episode.closed:
                raise RequestError(410, f"episode {episode.episode_id} is closed", code="episode_closed")
            return self._complete(episode, request)

    def _episode_of(self, authorization: str | None) -> EpisodeRecord:
        scheme, _, token = (authorization or "").partition(" ")
        with self._episodes_lock:
            episode = self._episodes.get(token.strip()) if scheme.lower() == "bearer" else None
        if episode is None:
            raise RequestError(401, "the API key must be the id of an open episode (Authorization: Bearer "
                                    "<episode id>)", code="invalid_api_key", kind="authentication_error")  # fmt: skip
        return episode

    def _parse(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported: ask for the whole completion", param="stream")
        if body.get("n", 1) != 1:
            raise RequestError(400, f"n={body.get('n')} is not supported: one choice per request", param="n")
        if body.get("logit_bias"):
            raise RequestError(400, "logit_bias is not supported: it would change the sampling distribution",
                               param="logit_bias")  # fmt: skip
        response_format = body.get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise RequestError(400, "response_format other than text is not supported", param="response_format")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list", param="messages")
        tools = body.get("tools") or None
        if body.get("tool_choice") == "none":
            tools = None
        if tools is not None and not self._renders_tools:
            raise RequestError(400, "the model's chat template does not render tools", param="tools")
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_action_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(400, "max_tokens must be a positive integer", param="max_tokens")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError(400, "stop must be a string or a list of strings", param="stop")
        return dict(messages=[self._message(i, m) for i, m in enumerate(messages)], tools=tools,
                    logprobs=bool(body.get("logprobs")) or top > 0, top_logprobs=top,
                    max_tokens=min(max_tokens, self.max_action_tokens), stop=tuple(stop))  # fmt: skip

    @staticmethod
    def _message(i: int, message: Any) -> dict[str, Any]:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}] must have a role in {sorted(ROLES)}", param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
                raise RequestError(400, f"messages[{i}]: only text content parts are supported",
                                   param=f"messages[{i}].content")  # fmt: skip
            content = "\n".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param=f"messages[{i}].content")  # fmt: skip
        out = {k: v for k, v in message.items() if k not in ("role", "content")}
        out |= {"role": ROLES[message["role"]], "content": content if content is not None else ""}
        if out.get("tool_calls"):
            calls = [(call, call.get("function", {})) for call in out["tool_calls"] if isinstance(call, Mapping)]
            out["tool_calls"] = [{**call, "function": {**f, "arguments": _arguments(f.get("arguments"))}}
                                 for call, f in calls]  # fmt: skip
        return out

    def _render(self, episode: EpisodeRecord, request: dict[str, Any]) -> str:
        messages = []
        for message in request["messages"]:
            generated = None
            if message["role"] == "assistant":
                calls = _tool_calls_key(message.get("tool_calls"))
                generated = (episode.returned.get((message["content"], calls))
                             or episode.returned.get((message["content"].strip(), calls)))  # fmt: skip
            messages.append({"role": "assistant", "content": generated} if generated is not None else message)
        context = dict(self.chat_format.context) | ({"tools": request["tools"]} if request["tools"] else {})
        try:
            return self.chat_format.template.render(messages, add_generation_prompt=True, **context)
        except ValueError as e:  # ChatTemplateError
            raise RequestError(400, f"the chat template cannot render these messages: {e}", param="messages") from None

    def _complete(self, episode: EpisodeRecord, request: dict[str, Any]) -> dict:
        if episode.failure is not None:
            raise RequestError(400, episode.failure[1], code=episode.failure[0])
        rendered = self._render(episode, request)
        current = episode.segments[-1] if episode.segments else None
        extends = current is not None and rendered.startswith(current.text)
        rest = rendered[len(current.text):] if extends else rendered
        if extends and current.stop_token_text and rest.startswith(current.stop_token_text):
            rest = rest[len(current.stop_token_text):]  # the sampled stop token is the template's own end of turn
        observation = np.asarray(self.tokenizer.encode(rest), np.int32)
        prompt = np.concatenate([*current.tokens, observation]).astype(np.int32) if extends else observation
        if len(prompt) + 1 > self.engine.max_total_tokens:
            episode.truncated = True
            raise RequestError(400, f"the prompt has {len(prompt)} tokens; this server's context is "
                                    f"{self.engine.max_total_tokens} tokens", code="context_length_exceeded",
                               param="messages")  # fmt: skip
        remaining = episode.token_budget - episode.generated_tokens
        if remaining <= 0:
            message = f"episode {episode.episode_id} spent its budget of {episode.token_budget} generated tokens"
            episode.failure = ("token_budget_exceeded", message)
            raise RequestError(400, message, code="token_budget_exceeded")
        params, version = episode.weights()
        future = self.engine.submit(prompt, max_new_tokens=min(request["max_tokens"], remaining),
                                    stop_ids=self._stop_ids, stop_strings=request["stop"],
                                    key=jax.random.fold_in(episode.key, episode.requests),
                                    weights=(params, version))  # fmt: skip
        episode.requests += 1
        self.stats["requests"] += 1
        completion = future.result()
        episode.generated_tokens += len(completion.tokens)
        if extends:
            current.add_context(observation, turn=current.num_actions - 1)
        else:
            if current is not None:
                episode.prefix_mismatches += 1
                self.stats["prefix_mismatch"] += 1
                at = next((i for i, (a, b) in enumerate(zip(current.text, rendered)) if a != b), len(rendered))
                log.info("episode %s: the request's rendering departs from the segment's text at character %d "
                         "(%r vs %r): new segment", episode.episode_id, at, current.text[max(0, at - 20): at + 40],
                         rendered[max(0, at - 20): at + 40])  # fmt: skip
            current = Segment(text=rendered)
            current.add_context(prompt, turn=-1)
            episode.segments.append(current)
        current.add_action(completion)
        generated = self.tokenizer.decode(completion.tokens)
        ended_on_token = completion.finish == "stop_token"
        raw = self.tokenizer.decode(completion.tokens[:-1]) if ended_on_token else generated
        current.text = rendered + raw
        current.stop_token_text = self.tokenizer.decode(completion.tokens[-1:]) if ended_on_token else ""
        current.last_action = generated
        message = self._message_of(completion, generated, tools=request["tools"] is not None)
        for content in {message["content"] or "", (message["content"] or "").strip()}:
            episode.returned[(content, _tool_calls_key(message.get("tool_calls")))] = raw
        if episode.closed:
            raise RequestError(410, f"episode {episode.episode_id} was closed while this request ran",
                               code="episode_closed")  # fmt: skip
        finish = "tool_calls" if message.get("tool_calls") else "length" if completion.finish == "length" else "stop"
        logprobs = self._logprobs(prompt, completion, request["top_logprobs"]) if request["logprobs"] else None
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion.tokens),
                      "total_tokens": len(prompt) + len(completion.tokens)},
            "sao": {"episode_id": episode.episode_id, "segment": len(episode.segments) - 1,
                    "policy_version": completion.version, "prompt_token_ids": prompt.tolist(),
                    "completion_token_ids": completion.tokens.tolist()},
        }  # fmt: skip

    def _message_of(self, completion: Completion, generated: str, *, tools: bool) -> dict[str, Any]:
        if completion.finish == "stop_token":
            content = self.tokenizer.decode(completion.tokens[:-1])
        elif completion.finish == "stop_string":
            content = generated[: completion.stop_at]
        else:
            content = generated
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tools:
            content, calls = parse_tool_calls(content)
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        return message

    # --- log-probabilities --------------------------------------------------------------------------------

    def _token_entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([int(token)])
        return {"token": text, "logprob": float(logprob) if math.isfinite(logprob) else NO_PROBABILITY,
                "bytes": list(text.encode("utf-8"))}  # fmt: skip

    def _logprobs(self, prompt: np.ndarray, completion: Completion, top: int) -> dict[str, Any]:
        entries = [self._token_entry(t, lp) for t, lp in zip(completion.tokens, completion.logprobs)]
        if top and len(completion.tokens):
            ids, values = self._top_logprobs(prompt, completion, top)
            for entry, row_ids, row_values in zip(entries, ids, values):
                entry["top_logprobs"] = [self._token_entry(i, v) for i, v in zip(row_ids, row_values)]
        else:
            for entry in entries:
                entry["top_logprobs"] = []
        return {"content": entries, "refusal": None}

    def _top_logprobs(self, prompt: np.ndarray, completion: Completion, top: int):
        """The `top` likeliest tokens under log μ at each completion position: one forward over
        prompt ‖ completion with the completion's weights and the sampler's transform."""
        sequence = np.concatenate([prompt, completion.tokens])
        width = max(MIN_PREFILL_WIDTH, 1 << (len(sequence) - 1).bit_length())
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(sequence)] = sequence
        mask = np.arange(width)[None] < len(sequence)
        ids, values = jax.device_get(self._score(completion.params, tokens, mask, top))
        rows = slice(len(prompt) - 1, len(sequence) - 1)  # position t predicts token t + 1
        return ids[0, rows], values[0, rows]

    def _score_impl(self, params, tokens, mask, top: int):
        sampler = self.engine.sampler
        logits = nnx.merge(sampler.graphdef, params).forward(tokens, attention_mask=mask)[0]
        values, ids = jax.lax.top_k(sampler.log_probs(logits), top)
        return ids, values
