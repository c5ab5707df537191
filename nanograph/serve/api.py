"""The endpoints, and OpenAI's response formats: whole answers, SSE chunks, logprobs, errors.

A generation request is checked (its body, its model, its SamplingParams) and handed to the
engine thread, which answers with the request id or the ValueError that refused it; only then
does the response start. Streamed, each step dict becomes a chunk per completion that got
something new in it (`deltas`); not streamed, the last dict is the answer. Errors have OpenAI's
body, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request, 404 for an
unknown model, 503 until the engine is ready, 500 when a step fails (EngineError).

The two generation endpoints are plain Starlette routes, the lean path through the stack: their
body is parsed and checked by pydantic in one call (`model_validate_json`), not by FastAPI's
request layers, and a stream is Starlette's response without the anyio task group it starts
per request to listen for the client's leaving (the job's queue hears of that instead:
`generate`). Those two layers were about half of the app's own time per request: time in which
the event loop holds the GIL that the engine thread shares.
"""
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from nanograph import LoRARequest
from nanograph.serve.engine_thread import EngineError, EngineThread, Job
from nanograph.serve.protocol import ChatRequest, CompletionRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, param=None, code=None):
        self.body = {"error": {"message": message,
                               "type": "invalid_request_error" if status < 500 else "server_error",
                               "param": param,
                               "code": code}}
        self.response = JSONResponse(self.body, status_code=status)


def create_app(engine: EngineThread, served_model: str, loras: dict[str, LoRARequest]) -> FastAPI:
    app = FastAPI(title="nanograph")

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, error: EngineError):
        return APIError(500, str(error)).response

    @app.exception_handler(ValidationError)
    async def invalid_body(request: Request, error: ValidationError):
        first = error.errors()[0]  # (an unknown field's: "Extra inputs are not permitted")
        where = first["loc"]  # the field and the place inside it; none: the body as a whole
        if not where:
            return APIError(400, first["msg"]).response
        path = ".".join(map(str, where))
        return APIError(400, f"{path}: {first['msg']}", where[0]).response

    def check_ready():
        if not engine.ready.is_set():
            raise APIError(503, engine.error or "the engine is not ready")

    @app.get("/health")
    async def health():
        check_ready()

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list",
                "data": [{"id": name, "object": "model", "created": int(time.time()),
                          "owned_by": "nanograph"} for name in [served_model, *loras]]}

    def adapter(model: str | None) -> LoRARequest | None:
        """The LoRA adapter that `model` names; None for the served model itself."""
        if model is None or model == served_model:
            return None
        if model not in loras:
            raise APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")
        return loras[model]

    async def generate(kind: type[CompletionRequest | ChatRequest], request: Request):
        body = kind.model_validate_json(await request.body())
        check_ready()
        try:
            job = Job(**body.job(engine.llm.config.max_model_len), lora=adapter(body.model))
            outputs = engine.generate(job)
            await anext(outputs)  # its request id: the engine has taken it
        except ValueError as e:
            raise APIError(400, str(e)) from None
        reply = Reply(kind is ChatRequest, body.model or served_model,
                      engine.tokenizer, job.params.logprobs)
        # The client's leaving ends its outputs (their finally aborts the request): once the body
        # is read, uvicorn's receive() returns when the connection closes (or the response ends).
        # (The task lives on as a waiter of uvicorn's event, until then.)
        gone = asyncio.ensure_future(request.receive())
        gone.add_done_callback(lambda _: job.queue.put_nowait(ClientGone()))
        if body.stream:
            return EventStream(reply.events(outputs, body.stream_options.include_usage))
        async for out in outputs:
            pass
        return JSONResponse(reply.whole(out))

    # (plain Starlette routes: the module docstring says why)
    app.add_route("/v1/completions", partial(generate, CompletionRequest), methods=["POST"])
    app.add_route("/v1/chat/completions", partial(generate, ChatRequest), methods=["POST"])
    return app


class ClientGone(EngineError):
    """Put in a job's queue when its client has closed the connection: its outputs end, and
    the error that answers it (a 500, or an error event) goes nowhere."""


class EventStream(StreamingResponse):
    """Starlette's streamed response without its own watch for the client's leaving (an anyio
    task group a request, a large share of the app's time): `generate` has a cheaper one."""
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        await self.stream_response(send)


@dataclass
class Reply:
    """How one request's answer is worded: OpenAI's completion or chat format, whole or streamed."""
    chat: bool
    model: str
    tokenizer: object        # for the logprobs' token strings; None: "token_id:N"
    top_logprobs: int | None
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, stream: bool) -> dict:
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        return {"id": self.id, "object": kind,
                "created": self.created, "model": self.model}

    def whole(self, out: dict) -> dict:
        return {**self.head(stream=False),
                "choices": [self.choice(i, c, stream=False) for i, c in enumerate(out["outputs"])],
                "usage": usage(out)}

    async def events(self, outputs, usage_chunk: bool):
        """Server-sent events: chunks as the steps come, then `data: [DONE]`."""
        sent = None  # the step dict the chunks so far came from
        try:
            async for out in outputs:
                for i, new in deltas(sent, out):
                    choice = self.choice(i, new, stream=True, first=sent is None)
                    yield sse({**self.head(stream=True), "choices": [choice]})
                sent = out
            if usage_chunk:
                yield sse({**self.head(stream=True), "choices": [], "usage": usage(sent)})
        except EngineError as e:  # the status line has gone: the error is an event
            yield sse(APIError(500, str(e)).body)
        yield "data: [DONE]\n\n"

    def choice(self, i: int, c: dict, stream: bool, first: bool = False) -> dict:
        """Completion dict `c` (whole, or its new part) as choice `i`."""
        text = c["text"] or ""  # None: the model has no tokenizer
        message = {"role": "assistant", "content": text}
        if not self.chat:
            content = {"text": text}
        elif stream:
            content = {"delta": message if first else {"content": text}}
        else:
            content = {"message": message}
        return {"index": i,
                **content,
                "logprobs": self.logprobs(c),
                "finish_reason": c["finish_reason"],
                "stop_reason": c["stop_reason"]}

    def logprobs(self, c: dict) -> dict | None:
        """OpenAI's logprobs: chat's entries with their top N, or completions' three lists."""
        if c["logprobs"] is None:
            return None
        # per token: the sampled one's entry, and the entries of the top N and it, best first
        sampled = [self.entry(t, top[t]) for t, top in zip(c["token_ids"], c["logprobs"])]
        ranked = [[self.entry(t, p) for t, p in sorted(top.items(), key=lambda tp: -tp[1])]
                  for top in c["logprobs"]]
        if self.chat:
            return {"content": [{**entry, "top_logprobs": best[:self.top_logprobs]}
                                for entry, best in zip(sampled, ranked)]}
        return {"tokens": [entry["token"] for entry in sampled],
                "token_logprobs": [entry["logprob"] for entry in sampled],
                "top_logprobs": [{e["token"]: e["logprob"] for e in best} for best in ranked]}

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token_id]) if self.tokenizer else f"token_id:{token_id}"
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def deltas(sent: dict | None, out: dict):
    """(index, the new part of its completion dict) for each completion of step dict `out` that
    has text, logprobs or its end that `sent`, the dict sent before, had not. In the first
    chunk (sent is None) every completion has one: chat's first delta names the role."""
    nothing = {"text": "", "token_ids": [], "finish_reason": None}
    for i, c in enumerate(out["outputs"]):
        before = sent["outputs"][i] if sent else nothing
        if before["finish_reason"]:
            continue
        n = len(before["token_ids"])
        new = {**c,
               "text": (c["text"] or "")[len(before["text"] or ""):],
               "token_ids": c["token_ids"][n:],
               "logprobs": None if c["logprobs"] is None else c["logprobs"][n:]}
        if sent is None or new["text"] or new["logprobs"] or new["finish_reason"]:
            yield i, new


def usage(out: dict) -> dict:
    prompt = len(out["prompt_token_ids"])
    completion = sum(len(c["token_ids"]) for c in out["outputs"])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
