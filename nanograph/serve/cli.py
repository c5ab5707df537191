"""`nanograph-serve` / `python -m nanograph.serve`: flags, start-up and shutdown.

Every field of nanograph.config.Config is a flag, made from the dataclass (`max_model_len` ->
`--max-model-len`, a bool -> `--enforce-eager` / `--no-enforce-eager`, a list -> several
values, a dict -> JSON); one not given is not passed, so the LLM's own default holds.

What can be checked before the engine starts is checked first, each a clear error and a non-zero
exit: the knobs (a Config is made from them), the LoRA modules (each adapter read against the
model's config) and the port (bound here, then handed to uvicorn).
"""
import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import types
import typing

import uvicorn

from nanograph import LoRARequest
from nanograph.config import Config
from nanograph.dp.launcher import add_replica_flags, serve_replicas
from nanograph.lora.adapter import read_adapter
from nanograph.serve.api import create_app
from nanograph.serve.engine_thread import EngineThread
from nanograph.serve.shell import chat_shell


def add_knob(group, knob: dataclasses.Field):
    """The flag for one Config field: its type without `| None`, its default left to Config."""
    kind = next((t for t in typing.get_args(knob.type) if t is not types.NoneType), knob.type)
    flag = "--" + knob.name.replace("_", "-")
    options = dict(default=argparse.SUPPRESS, help=f"(default: {knob.default})")
    if kind is bool:
        options.update(action=argparse.BooleanOptionalAction)
    elif kind is dict:
        options.update(type=json.loads, help=f"JSON (default: {knob.default})")
    elif typing.get_origin(kind) is list:
        options.update(nargs="+", type=typing.get_args(kind)[0])
    else:
        options.update(type=kind)
    group.add_argument(flag, **options)


def parse_args(argv):
    """The flags, the LLM's knobs that were given, and the LoRA modules by name."""
    parser = argparse.ArgumentParser(prog="nanograph-serve",
                                     description="An OpenAI-compatible server for nanograph.")
    parser.add_argument("model", help="a local HF-format directory or a hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients use (default: MODEL)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="PEFT adapters, chosen by naming them as the request's model")
    parser.add_argument("--shell", action="store_true", help="chat in the terminal instead")
    add_replica_flags(parser)
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                        help="a larger request body is refused at once (413)")
    engine_flags = parser.add_argument_group("engine knobs (nanograph.LLM's)")
    knobs = [knob for knob in dataclasses.fields(Config) if knob.name != "model"]
    for knob in knobs:
        add_knob(engine_flags, knob)
    args = parser.parse_args(argv)
    given = {knob.name: getattr(args, knob.name) for knob in knobs if hasattr(args, knob.name)}
    loras = {}
    for module in args.lora_modules:
        name, _, path = module.partition("=")
        if not name or not path:
            parser.error(f"--lora-modules takes NAME=PATH, got {module!r}")
        loras[name] = LoRARequest(name, path)
    if loras:
        given.setdefault("enable_lora", True)
    return args, given, loras


class Server(uvicorn.Server):
    """uvicorn's server, which stops the engine first when it shuts down (SIGTERM, Ctrl-C, or
    the engine thread's end): every open stream ends at once, so uvicorn's wait for the
    connections to close is short."""

    engine: EngineThread

    async def shutdown(self, sockets=None):
        self.engine.stop()
        await super().shutdown(sockets)


def main(argv=None):
    args, knobs, loras = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        config = Config(args.model, **knobs)
        for lora in loras.values():
            read_adapter(lora, config.hf_config, config.max_lora_rank, "--lora-modules: ")
    except ValueError as e:
        sys.exit(f"nanograph-serve: {e}")
    if args.data_parallel_size > 1:
        return serve_replicas(args, knobs, sys.argv[1:] if argv is None else argv)
    if args.shell:
        with contextlib.suppress(KeyboardInterrupt):
            return chat_shell(args.model, knobs)
    served_model = args.served_model_name or args.model
    engine = EngineThread(args.model, knobs, served_model)
    app = create_app(engine, served_model, loras, args.max_request_body_bytes)
    # (a request still open 5 s after shutdown began is cancelled)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port,
                                   timeout_graceful_shutdown=5))
    port = server.config.bind_socket()  # in use: uvicorn says so and exits (3)
    server.engine = engine
    engine.on_exit = lambda: setattr(server, "should_exit", True)
    engine.thread.start()  # builds the LLM while uvicorn opens the port
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[port])
    engine.stop()  # (the server's shutdown has stopped it already)
    # the engine thread closes the LLM: wait for it 15 s at most (an engine still building, or
    # stuck in a step, is left to the process's end)
    engine.thread.join(15)
    if engine.error:
        sys.exit(f"nanograph-serve: {engine.error}")
