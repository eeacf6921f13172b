"""What every handler needs: the engine and its worker, the prompt renderer, the tool-call parser,
the served name, the metrics. Built once the model has loaded (until then the server answers 503)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from moestream.runtime.sampling import SamplingParams
from moestream.serve.chat import PromptRenderer
from moestream.serve.errors import bad_request, get
from moestream.serve.generation import Generation
from moestream.serve.metrics import ServerMetrics
from moestream.serve.tool_calls import ToolCallParser, parser_for_template
from moestream.serve.worker import EngineWorker

log = logging.getLogger("moestream.serve")

DEFAULT_MAX_TOKENS = 8192


@dataclass
class ServeOptions:
    model_name: str = "moestream"
    api_key: str | None = None
    max_queue: int = 256                  # requests waiting for a batch place before 429
    max_body_bytes: int = 32 * 2**20      # a request body larger than this is refused (413)
    # Tokens one reply may generate: the default when a request names none (Codex never does) and the
    # ceiling on what one asks for (opencode asks for 32,000). 8192 holds a whole-file write in one
    # tool call, yet bounds a reply stuck repeating itself to minutes, not the whole context. 0: no cap
    # but the context.
    max_tokens: int = DEFAULT_MAX_TOKENS
    # Seconds without a byte on a stream (queued, prefilling, or a tool call still being written)
    # before a keep-alive is sent: agents give up on a silent stream after a few minutes.
    keepalive_s: float = 10.0
    chat_template: str | None = None      # a Jinja chat template used instead of the checkpoint's
    access_log: bool = True               # one info line per request


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class ServerState:
    engine: object
    worker: EngineWorker
    renderer: PromptRenderer
    parser: ToolCallParser
    model_name: str
    metrics: ServerMetrics
    options: ServeOptions = field(default_factory=ServeOptions)
    created: int = field(default_factory=lambda: int(time.time()))
    _dropped_seen: set[str] = field(default_factory=set)

    @classmethod
    def build(cls, engine, options: ServeOptions) -> ServerState:
        metrics = ServerMetrics(engine)
        renderer = PromptRenderer(engine.tokenizer, options.chat_template)
        worker = EngineWorker(engine, options.max_queue, metrics)
        metrics.worker = worker
        return cls(engine, worker, renderer, parser_for_template(renderer.template), options.model_name, metrics,
                   options)

    def start(self, ids: list[int], params: SamplingParams, tools: list[dict] | None = None,
              chat: bool = True) -> Generation:
        """Submit a prompt: a chat reply also ends at the template's end of turn."""
        stops = set(params.stop)
        stop_ids: frozenset[int] = frozenset()
        if chat:
            r = self.renderer
            if r.end_of_turn_id is not None and r.end_of_turn_id not in self.engine.eos_ids:
                stop_ids = frozenset({r.end_of_turn_id})
            elif r.end_of_turn is not None and r.end_of_turn not in params.stop:
                params.stop.append(r.end_of_turn)   # spelled in ordinary tokens: a stop string
        return Generation(self.worker, ids, params, tools, self.parser, stop_ids=stop_ids, user_stops=stops,
                          keepalive_s=self.options.keepalive_s or None)

    def note_dropped(self, dropped: list[str]) -> None:
        """Say once per kind of tool that the model will not see it, and why."""
        for what in dropped:
            if what not in self._dropped_seen:
                self._dropped_seen.add(what)
                log.info("a tool the model cannot call was left out: %s", what)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def check_prompt(self, ids: list[int]) -> list[int]:
        """A prompt that leaves room for at least one generated token, or a 400 that says by how much."""
        if not ids:
            raise bad_request("the prompt is empty.")
        if len(ids) >= self.max_context:
            raise bad_request(f"the prompt has {len(ids)} tokens but the context holds {self.max_context} "
                              f"(the server's --max-context); shorten the conversation.")
        vocab = self.engine.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1}).", "prompt")
        return ids

    def sampling(self, body: dict, max_fields: tuple[str, ...], stop_field: str = "stop",
                 default_temperature: float = 1.0, required_max: bool = False) -> SamplingParams:
        """Sampling parameters of a request; max tokens beyond the server's cap (or the context) are
        clamped to it, and a request that names none gets the cap."""
        n = get(body, "n", int, 1)
        if n != 1:
            raise bad_request(f"n={n} is not supported: this server returns one choice per request (n=1).", "n")
        if get(body, "logprobs", (bool, int)) or get(body, "top_logprobs", int):
            raise bad_request("logprobs are not supported by this server; leave them out.", "logprobs")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if get(body, name, float, 0.0) not in (0.0, 1.0 if name == "repetition_penalty" else 0.0):
                raise bad_request(f"{name} is not supported by this server; leave it out or set it to its neutral value.", name)
        fmt = get(body, "response_format", dict)
        if fmt and fmt.get("type", "text") != "text":
            raise bad_request(f"response_format {fmt.get('type')!r} is not supported; only 'text' is.", "response_format")
        max_tokens = None
        for name in max_fields:
            max_tokens = get(body, name, int)
            if max_tokens is not None:
                if max_tokens < 1:
                    raise bad_request(f"'{name}' must be at least 1, got {max_tokens}.", name)
                break
        if max_tokens is None and required_max:
            raise bad_request(f"'{max_fields[0]}' is required.", max_fields[0])
        cap = self.options.max_tokens or self.max_context   # the server's --max-tokens: default and ceiling
        max_tokens = min(max_tokens or cap, cap, self.max_context)
        stop = body.get(stop_field)
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
            raise bad_request(f"'{stop_field}' must be a string or an array of strings.", stop_field)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=get(body, "temperature", float, default_temperature),
            top_p=get(body, "top_p", float, 1.0), top_k=get(body, "top_k", int, 0) or 0,
            min_p=get(body, "min_p", float, 0.0), seed=get(body, "seed", int),
            stop=[s for s in stop or [] if s], ignore_eos=bool(get(body, "ignore_eos", bool, False)))
        try:
            params.validate()
        except Exception as exc:   # InputError: one sentence naming the value
            raise bad_request(str(exc)) from exc
        return params
