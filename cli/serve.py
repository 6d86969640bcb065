from __future__ import annotations

import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

from cli.main import app
from engine.errors import GDecodeError
from engine.llm import DEFAULT_MODEL, LLM
from engine.serving import ServingEngine

SHUTDOWN_WAIT_S = 10.0
SWITCH_INTERVAL_S = 0.0001


def _uvicorn_server(config, on_signal):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a signal first ends the running generation (so open streams
        finish at once) and the process then exits normally instead of re-raising the signal."""

        def handle_exit(self, sig: int, frame) -> None:
            on_signal()
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self.should_exit = True

    return Server(config)


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise GDecodeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run_server(engine: ServingEngine, model_id: str, host: str, port: int, http: str = "auto",
               loop: str = "auto") -> None:
    """Start `engine` (loading its model) and serve it on host:port until SIGINT or SIGTERM. `http` and
    `loop` are uvicorn's: auto takes httptools and uvloop when installed (they are dependencies)."""
    import uvicorn

    from cli.server_app import create_app

    sock = _listen(host, port)
    # The event loop's thread must get the interpreter soon after the engine's thread emits a token. With
    # the default 5 ms switch interval, a prefill's Python launch loop could keep it that long.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    llm = engine.start()
    api = create_app(engine, model_id)
    config = uvicorn.Config(api, host=host, port=port, log_config=None, log_level=logging.getLogger().level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=SHUTDOWN_WAIT_S, http=http, loop=loop)
    server = _uvicorn_server(config, engine.stop)
    logging.getLogger("gdecode.serve").info("serving %s on http://%s:%d (%s backend, context %d tokens)",
                                            model_id, host, sock.getsockname()[1], llm.backend.name,
                                            llm.max_context)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        engine.join(SHUTDOWN_WAIT_S)


@app.command()
def serve(
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory or .gguf file."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on."),
    backend: str = typer.Option("auto", help="auto | cuda | numpy"),
    max_context: Optional[int] = typer.Option(None, help="KV-cache length (default: the model's limit)."),
    max_queue: int = typer.Option(64, min=1, help="Requests that may wait; more get 429."),
    model_name: Optional[str] = typer.Option(None, help="The id the API shows (default: the folder or file name)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Launch the decode kernels eagerly (CUDA)."),
    log_level: str = typer.Option("info", help="debug | info | warning | error"),
    quantize: Optional[str] = typer.Option(None, help="Quantize a bf16/fp16/fp32 model at load: q8_0 | q4_0."),
):
    """Serve the model over an OpenAI-compatible HTTP API (and a chat page at /)."""
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise GDecodeError(f"unknown --log-level {log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    engine = ServingEngine(lambda: LLM(model, backend=backend, max_context=max_context, use_graph=not no_graph,
                                       quantize=quantize),
                           max_waiting=max_queue)
    model_id = model_name or (model.stem if model.suffix == ".gguf" else model.resolve().name)
    run_server(engine, model_id, host, port)
