"""What every handler needs: the engine and its worker, the prompt renderer, the tool-call parser,
the served name, the metrics. Built once the model has loaded (until then the server answers 503)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from moestream.runtime.sampling import SamplingParams
from moestream.serve.chat import END_OF_TURN, PromptRenderer
from moestream.serve.errors import bad_request, get
from moestream.serve.metrics import ServerMetrics
from moestream.serve.tool_calls import ToolCallParser, parser_for_template
from moestream.serve.worker import EngineWorker


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
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, engine, model_name: str, max_queue: int) -> ServerState:
        metrics = ServerMetrics(engine)
        renderer = PromptRenderer(engine.tokenizer)
        return cls(engine, EngineWorker(engine, max_queue, metrics), renderer, parser_for_template(renderer.template),
                   model_name, metrics)

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
                 default_temperature: float = 1.0, required_max: bool = False, chat: bool = True) -> SamplingParams:
        """Sampling parameters of a request; max tokens beyond the context are clamped to it."""
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
        if max_tokens is None:
            if required_max:
                raise bad_request(f"'{max_fields[0]}' is required.", max_fields[0])
            max_tokens = self.max_context
        stop = body.get(stop_field)
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
            raise bad_request(f"'{stop_field}' must be a string or an array of strings.", stop_field)
        params = SamplingParams(
            max_tokens=min(max_tokens, self.max_context),
            temperature=get(body, "temperature", float, default_temperature),
            top_p=get(body, "top_p", float, 1.0), top_k=get(body, "top_k", int, 0) or 0,
            min_p=get(body, "min_p", float, 0.0), seed=get(body, "seed", int),
            stop=[s for s in stop or [] if s], ignore_eos=bool(get(body, "ignore_eos", bool, False)))
        if chat and self.renderer.uses_fallback and END_OF_TURN not in params.stop:
            params.stop.append(END_OF_TURN)   # the fallback template's end of turn is plain text to this tokenizer
        try:
            params.validate()
        except Exception as exc:   # InputError: one sentence naming the value
            raise bad_request(str(exc)) from exc
        return params
