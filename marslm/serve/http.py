"""The HTTP server under the app: uvicorn on a socket bound before the model loads, its h11
protocol with deadlines and a connection cap, and a shutdown that drains the engine.

SIGTERM: stop accepting connections, let in-flight requests finish for up to
``shutdown_timeout`` seconds, cancel the rest (each gets a 503 error object, or a last stream
event saying so), stop the engine, return (exit status 0).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import socket
import threading
from functools import partial

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import UserError
from .app import create_app
from .config import ServeConfig, no_extra_args, served_names
from .engine import Engine
from .wire import error_body

log = logging.getLogger("marslm.server")


def serve_checkpoint(model: str, config: ServeConfig, extra_args: list[str]) -> int:
    """``marslm serve`` on marslm's own engine (options after ``--`` are for vLLM's)."""
    no_extra_args(extra_args)
    serve(model, config)
    return 0


def serve(model: str, config: ServeConfig | None = None) -> None:
    """Load ``model``, bind ``host:port`` (0: any free port) and serve until SIGINT/SIGTERM."""
    config = config or ServeConfig()
    logging.getLogger("marslm").setLevel(config.log_level.upper())  # disconnects and timeouts are info lines
    sock = _bind(config.host, config.port)  # before the slow model load: a taken port fails at once
    try:
        engine = Engine.from_pretrained(model, config)
    except BaseException:
        sock.close()
        raise
    sock.listen(2048)
    app = create_app(engine, model)
    server = _Server(engine, app)
    bound_host, bound_port = sock.getsockname()[:2]
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", config.host)
    name = served_names(model, config.served_model_name)[0]
    drafter = f", drafter {engine.drafter_card['model']}" if engine.drafter_card else ""
    print(
        f"marslm serve: {name} listening on http://{_url_host(bound_host)}:{bound_port} "
        f"(max batch {engine.max_batch}, tau {engine.controller.tau}, policy {engine.controller.policy}, "
        f"{engine.decoded_with_line()}{drafter})",
        flush=True,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with the
    # default SIGTERM action that would kill the process (status -15) after a clean shutdown.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: shut down"))
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(0)
        sock.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown drains the engine while it waits for the connections:
    requests still running at the deadline are cancelled there, and their handlers answer 503
    themselves."""

    def __init__(self, engine: Engine, app):
        config = engine.config
        self.engine = engine
        # uvicorn's own deadline (it then cancels handlers outright) is only a safety net behind the engine's.
        super().__init__(
            uvicorn.Config(
                app,
                log_level=config.log_level,
                access_log=False,
                lifespan="on",
                http=partial(_Protocol, limits=config),
                timeout_keep_alive=config.keep_alive_timeout,
                timeout_graceful_shutdown=math.ceil(config.shutdown_timeout) + 10,
            )
        )

    async def shutdown(self, sockets=None):
        drain = asyncio.ensure_future(asyncio.to_thread(self.engine.stop, self.engine.config.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            await drain


_TOO_MANY = json.dumps(
    error_body("too many open connections; retry later", "server_error", code="too_many_connections")
).encode()


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with two guards for slow or many clients: a deadline for every
    request's line and headers (uvicorn has none: a client sending half a request held its socket
    for good), and a cap on open connections."""

    def __init__(self, *args, limits: ServeConfig, **kwargs):
        self.limits = limits
        self._head_timer = None
        super().__init__(*args, **kwargs)

    def connection_made(self, transport):
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("refusing a connection: %d are open already (--max-connections)", self.limits.max_connections)
            transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TOO_MANY), _TOO_MANY)
            )
            transport.close()
            return
        self._await_head()

    def on_response_complete(self):
        super().on_response_complete()
        self._await_head()

    def connection_lost(self, exc):
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self):
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_overdue)

    def _head_overdue(self):
        self._head_timer = None
        # IDLE: no complete request line and headers since the connection (or the last
        # response) began. A request being read or answered is the body deadline's business.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            host, port = self.client or ("?", 0)
            log.info(
                "client %s:%s sent no complete request head within %g s: closing",
                host,
                port,
                self.limits.header_timeout,
            )
            self.transport.close()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
