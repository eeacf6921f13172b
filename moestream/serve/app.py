"""The HTTP server: routes, API keys, body limits, error shapes, health, metrics, the access log.

`create_app(load)` returns a FastAPI app whose startup runs `load()` (the engine) in a thread: the
server answers `/health` with 503 while the model loads and warms up, then 200. Every error is a
one-sentence message in the shape of the API the client speaks (OpenAI `{"error": {...}}`,
Anthropic `{"type": "error", "error": {...}}` for `/v1/messages`), never a traceback. A client
that leaves before its answer is complete, streaming or not, is noticed at once: its sequence is
cancelled and the request is logged and counted with status 499 (nginx's "client closed request").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moestream.serve import anthropic_api, openai_api
from moestream.serve.errors import ApiError, bad_request
from moestream.serve.generation import Generation
from moestream.serve.state import ServeOptions, ServerState

__all__ = ["ServeOptions", "create_app"]

log = logging.getLogger("moestream.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499          # the status a request whose client left before its answer is counted under
LOG_KEY = "moestream.log"  # the ASGI scope entry where handlers leave what the access log reports
QUIET_PATHS = ("/health", "/metrics")   # polled by monitors: logged at debug only
METRICS_WAIT_S = 1.0       # how long a scrape waits for the engine's figures before answering without them


class AccessLog:
    """ASGI middleware: one line per request once its answer is complete (a stream at its end):
    method, route, status, prompt / cached / generated tokens, time to first token, total time."""

    def __init__(self, app, options: ServeOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        note: dict = {}
        scope[LOG_KEY] = note

        async def noting_send(message):
            if message["type"] == "http.response.start":
                note.setdefault("status", message["status"])
            await send(message)
        try:
            await self.app(scope, receive, noting_send)
        finally:
            status = note.get("gone") and CLIENT_GONE or note.get("status", 500)
            parts = [scope["method"], scope["path"], str(status)]
            if note.get("gone"):
                parts.append("(the client disconnected; its generation was cancelled)")
            gen: Generation | None = note.get("gen")
            if gen is not None:
                out = gen.outcome
                parts += [f"prompt={out.prompt_tokens}", f"cached={out.cached_tokens}", f"generated={out.completion_tokens}"]
                parts.append(f"ttft={gen.ttft:.2f}s" if gen.ttft is not None else "ttft=-")
            parts.append(f"total={time.perf_counter() - t0:.2f}s")
            if note.get("gone"):
                level = logging.INFO   # always said, access log or not
            elif not self.options.access_log or scope["path"] in QUIET_PATHS:
                level = logging.DEBUG
            else:
                level = logging.INFO
            log.log(level, " ".join(parts))


async def _client_left(receive) -> None:
    """Returns once the client has disconnected (the body has been read: nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, gen: Generation, work) -> tuple[bool, object]:
    """Run `work` (a coroutine reading `gen`) while watching the connection: (True, its result), or
    (False, None) as soon as the client disconnects, its sequence cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_left(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:   # also when this handler is itself cancelled
        gone.cancel()
        if not task.done():
            gen.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


def _anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, err: ApiError) -> JSONResponse:
    body = err.anthropic_body() if _anthropic(path) else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class Guard:
    """ASGI middleware: API key and declared body size, checked before a handler runs."""

    def __init__(self, app, options: ServeOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        err = None
        if self.options.api_key is not None:
            given = headers.get("x-api-key") or ""
            auth = headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if not hmac.compare_digest(given.encode(), self.options.api_key.encode()):
                err = ApiError(401, "the API key is missing or wrong; send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.")
        length = headers.get("content-length")
        if err is None and length is not None and length.isdigit() and int(length) > self.options.max_body_bytes:
            err = ApiError(413, f"the request body has {int(length)} bytes; the limit is {self.options.max_body_bytes}.")
        if err is not None:
            return await error_response(scope["path"], err)(scope, receive, send)
        return await self.app(scope, receive, send)


async def read_json(request: Request, limit: int) -> dict:
    raw = await request.body()
    if len(raw) > limit:
        raise ApiError(413, f"the request body has {len(raw)} bytes; the limit is {limit}.")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}).") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object.")
    return body


def create_app(load: Callable[[], object], options: ServeOptions | None = None) -> FastAPI:
    options = options or ServeOptions()
    status: dict = {"state": None, "error": None, "thread": None}

    def load_in_thread(loop: asyncio.AbstractEventLoop) -> None:
        try:
            engine = load()
            state = ServerState.build(engine, options)
            state.worker.start(loop)
            status["state"] = state
        except BaseException as exc:   # reported by /health and by the CLI, which then exits 1
            status["error"] = exc
            log.debug("loading failed: %s", exc)   # the CLI (or /health) reports it

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        thread = threading.Thread(target=load_in_thread, args=(asyncio.get_running_loop(),), name="moestream-load",
                                  daemon=True)
        status["thread"] = thread
        thread.start()
        yield
        state = status["state"]
        if state is not None:
            await asyncio.to_thread(state.worker.stop)
            await asyncio.to_thread(state.engine.close)   # the other ranks of an expert-parallel engine

    app = FastAPI(title="moestream", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.status = status
    app.add_middleware(Guard, options=options)
    app.add_middleware(AccessLog, options=options)   # outermost: it sees the Guard's refusals too

    def ready() -> ServerState:
        if status["error"] is not None:
            raise ApiError(503, f"the model failed to load: {status['error']}")
        if status["state"] is None:
            raise ApiError(503, "the model is still loading; retry shortly.", headers={"Retry-After": "5"})
        return status["state"]

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, err: ApiError):
        return error_response(request.url.path, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"there is no route {request.url.path}.", 405: f"{request.method} is not allowed on {request.url.path}."}
        return error_response(request.url.path, ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("request failed")
        return error_response(request.url.path, ApiError(500, f"the server failed on this request: {type(exc).__name__}: {exc}"))

    # ---- generation endpoints ---------------------------------------------------------------
    def noted(request: Request) -> dict:
        return request.scope.setdefault(LOG_KEY, {})

    async def answer(api: str, request: Request, start, respond, stream_of):
        state = ready()
        body = await read_json(request, options.max_body_bytes)
        try:
            started = await asyncio.to_thread(start, state, body)   # rendering long prompts is CPU work
        except ApiError as err:
            state.metrics.answered(api, err.status)
            raise
        gen: Generation = started[0]
        noted(request)["gen"] = gen
        if started[1]:   # stream
            return StreamingResponse(_guarded(api, state, gen, stream_of(state, *started), noted(request)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            complete, result = await unless_client_leaves(request, gen, respond(state, gen, *started[2:]))
        except ApiError as err:
            state.metrics.answered(api, err.status)
            raise
        if not complete:
            return _gone(api, state, gen, noted(request))
        state.metrics.answered(api, 200, gen.outcome.completion_tokens)
        return JSONResponse(result)

    def _gone(api: str, state: ServerState, gen: Generation, note: dict) -> Response:
        note["gone"] = True
        state.metrics.answered(api, CLIENT_GONE, gen.outcome.completion_tokens)
        return Response(status_code=CLIENT_GONE)   # nobody reads it: uvicorn drops it on a closed connection

    async def _guarded(api: str, state: ServerState, gen: Generation, stream: AsyncIterator[str],
                       note: dict) -> AsyncIterator[str]:
        ended = False
        try:
            async for piece in stream:
                yield piece
            ended = True
            state.metrics.answered(api, 200, gen.outcome.completion_tokens)
        except ApiError as err:   # the engine failed mid-stream: the API's error event, then the end
            ended = True
            state.metrics.answered(api, err.status)
            note["status"] = err.status
            if api == "messages":
                yield openai_api.sse(err.anthropic_body(), event="error")
            else:
                yield openai_api.sse(err.openai_body())
        finally:
            if not ended:   # the client disconnected (the stream was cancelled or closed mid-way)
                gen.cancel()
                _gone(api, state, gen, note)
            gen.worker.cancel(gen.request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer("chat", request, openai_api.start_chat, openai_api.chat_response,
                            lambda state, gen, stream, usage: openai_api.chat_stream(state, gen, usage))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer("completions", request, openai_api.start_completion, openai_api.completion_response,
                            lambda state, gen, stream, usage: openai_api.completion_stream(state, gen, usage))

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await answer("responses", request, openai_api.start_responses, openai_api.responses_result,
                            lambda state, gen, stream, echo: openai_api.responses_stream(state, gen, echo))

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await answer("messages", request, anthropic_api.start_messages, anthropic_api.message_response,
                            lambda state, gen, stream: anthropic_api.message_stream(state, gen))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        state = ready()
        body = await read_json(request, options.max_body_bytes)
        return JSONResponse(await asyncio.to_thread(anthropic_api.count_tokens, state, body))

    # ---- information ------------------------------------------------------------------------
    @app.api_route("/", methods=["GET", "HEAD"])
    async def root(request: Request):
        """Agents probe the base URL before their first request (Claude Code sends HEAD /)."""
        if request.method == "HEAD":
            return Response(status_code=200)
        state = status["state"]
        return {"name": "moestream", "model": state.model_name if state is not None else None,
                "health": "/health", "apis": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]}

    @app.get("/health")
    async def health():
        if status["error"] is not None:
            return JSONResponse({"status": "failed", "error": str(status["error"])}, status_code=503)
        if status["state"] is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    def model_card(state: ServerState, anthropic: bool) -> dict:
        if anthropic:
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.created))
            return {"type": "model", "id": state.model_name, "display_name": state.model_name, "created_at": created}
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "moestream",
                "max_model_len": state.max_context}

    @app.get("/v1/models")
    async def models(request: Request):
        state = ready()
        anthropic = "anthropic-version" in request.headers
        card = model_card(state, anthropic)
        if anthropic:
            return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        state = ready()
        if model_id != state.model_name:
            raise ApiError(404, f"the model {model_id!r} is not served here; this server serves {state.model_name!r}.")
        return model_card(state, "anthropic-version" in request.headers)

    @app.get("/metrics")
    async def metrics():
        state = ready()
        # The bank and prefix-cache figures are read between engine steps; a scrape during a long
        # step answers at once with the last ones (the queue gauges are live either way).
        refresh = asyncio.ensure_future(asyncio.to_thread(state.metrics.refresh_engine))
        await asyncio.wait({refresh}, timeout=METRICS_WAIT_S)
        return Response(state.metrics.render(refresh=False), media_type="text/plain; version=0.0.4")

    @app.get("/v1/cache/stats")
    async def cache_stats():
        state = ready()

        def read() -> dict:
            return {"prefix_cache": state.engine.prefix_cache_stats(), "bank": state.engine.stats(),
                    "running": state.worker.running, "waiting": state.worker.waiting}
        return await asyncio.to_thread(read)

    return app
