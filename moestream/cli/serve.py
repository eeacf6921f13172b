"""`moestream serve`: the engine behind an OpenAI- and Anthropic-compatible HTTP server."""

from __future__ import annotations

import contextlib
import errno
import socket
import sys
import time
from pathlib import Path

from moestream.cli.common import checked_model, engine_config, set_threads
from moestream.cli.flags import add_load_args, add_profile_args, integer, number
from moestream.errors import InputError, MoestreamError


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI (Chat, Completions, Responses) and Anthropic (Messages) compatible server")
    add_load_args(serve)
    add_profile_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=integer(0, 65535), default=8080, help="port to listen on (default 8080; 0: any free port)")
    serve.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY or x-api-key: KEY)")
    serve.add_argument("--max-batch", type=integer(1), default=8,
                       help="sequences decoded together (default 8; without --kv-cache-memory the cache is sized for "
                            "this many full contexts)")
    serve.add_argument("--max-queue", type=integer(1), default=256, help="requests waiting for a batch place before 429 (default 256)")
    serve.add_argument("--max-tokens", type=integer(0), default=8192,
                       help="tokens one reply may generate: the default when a request names none, and the ceiling "
                            "(default 8192: a whole-file write in one tool call, while a reply stuck repeating itself "
                            "stops within minutes; 0: only the context)")
    serve.add_argument("--keepalive", type=number(0), default=10.0, metavar="SECONDS",
                       help="seconds without a byte on a stream before a keep-alive is sent (default 10; 0: none): "
                            "agents give up on a stream silent for a few minutes")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file used instead of the checkpoint's")
    serve.add_argument("--no-access-log", action="store_true", help="no per-request log line")
    serve.add_argument("--prefix-cache-memory", default=None, metavar="SIZE",
                       help="device memory for finished conversations' KV, reused by prompts that extend them (0 = off; "
                            "a paged cache adds it to its blocks, which sequences and cached prefixes share; default: "
                            "the KV of --max-batch full contexts, at most 1GiB; none with --devices)")
    serve.add_argument("--served-model-name", default=None, help="the model name reported to clients (default: the folder name)")
    serve.add_argument("--shutdown-timeout", type=integer(0), default=10,
                       help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C")
    serve.set_defaults(func=run)


def read_chat_template(path: str | None) -> str | None:
    """The text of `--chat-template FILE`, read before anything loads."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the chat template {path} ({exc.strerror if isinstance(exc, OSError) else exc}); "
                         "give a readable Jinja template file.") from None


def run(args) -> int:
    """Load in the background behind a listening server (/health answers 503 until ready)."""
    checked_model(args)
    args.chat_template_text = read_chat_template(args.chat_template)   # a bad file is one line before anything loads
    sock = listen_socket(args.host, args.port)   # a port in use is one line before anything loads
    try:
        return serve(args, sock)
    finally:
        sock.close()


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (uvicorn serves on it): the address is checked before the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise InputError(f"--host {host} is not an address of this machine; give an IP address such as 127.0.0.1 "
                         "or 0.0.0.0.") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise InputError(f"port {port} on {host} is in use by another program; stop it or pass another "
                             "--port.") from None
        raise InputError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pass another --host or "
                         "--port.") from None
    return sock


def serve(args, sock: socket.socket) -> int:
    import ipaddress
    import logging

    import uvicorn

    from moestream.engine.plan import default_prefix_cache_bytes
    from moestream.serve.app import ServeOptions, create_app

    config = engine_config(args)
    set_threads(args)
    config.runtime.max_batch = args.max_batch
    config.runtime.kv_rows = args.max_batch
    if args.prefix_cache_memory is not None:
        config.runtime.prefix_cache_memory = args.prefix_cache_memory
    elif not config.runtime.devices:   # expert parallel keeps no prefix cache
        config.runtime.prefix_cache_memory = default_prefix_cache_bytes(config, args.max_batch)
    if args.warmup_tokens is None:   # compile kernels and capture graphs before the first request
        config.warm_start.warmup_tokens = 8
    config.validate()
    port = sock.getsockname()[1]
    name = args.served_model_name or Path(config.model).name or str(config.model)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="[moestream] %(message)s")
    try:
        exposed = not ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        exposed = args.host != "localhost"
    if exposed and args.api_key is None:
        print(f"[moestream] warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    server: uvicorn.Server | None = None

    def load():
        import moestream

        t0 = time.perf_counter()
        try:
            if config.quant.quantized:
                print("[moestream] quantizing on load (a slower start; `moestream convert` once to skip this)", file=sys.stderr)
            engine = moestream.load(config)
            if engine.tokenizer is None:
                print(f"[moestream] warning: {config.model} has no tokenizer files; only /v1/completions with token-id "
                      "prompts will work", file=sys.stderr)
            elif not getattr(engine.tokenizer, "chat_template", None):
                print("[moestream] warning: this checkpoint has no chat template; using ChatML with Qwen3-style tools",
                      file=sys.stderr)
            if args.verbose:
                print(engine.plan.memory.explain(), file=sys.stderr)
            print(f"[moestream] serving {name} on http://{args.host}:{port} (loaded in "
                  f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr)
            return engine
        except BaseException:
            if server is not None:
                server.should_exit = True
            raise

    options = ServeOptions(model_name=name, api_key=args.api_key, max_queue=args.max_queue, max_tokens=args.max_tokens,
                           keepalive_s=args.keepalive, chat_template=args.chat_template_text, access_log=not args.no_access_log)
    app = create_app(load, options)
    class GracefulServer(uvicorn.Server):
        """Uvicorn re-raises SIGTERM / SIGINT once it has shut down gracefully, so the process would die of
        the signal; a clean shutdown exits 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    server = GracefulServer(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    server.run(sockets=[sock])
    error = app.state.status["error"]
    if error is not None:
        raise error if isinstance(error, MoestreamError) else InputError(f"loading failed: {error}")
    return 0

