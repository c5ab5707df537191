"""The endpoints, and OpenAI's response formats: whole answers, SSE chunks, logprobs, errors.

A generation request is read (a 413 past `max_body_bytes`, at once), checked (its body, its
model), turned into SamplingParams and token ids (protocol.py: in the handler, or in a worker
thread for a large body, so neither the event loop's streams nor the engine thread wait on a
tokenizer), and handed to the engine thread, which answers that it has taken it or with the error
that refused it; only then does the response start. A request of several prompts is a Job each,
taken all or none; choice `i` of prompt `p` is choice `p * n + i`. Streamed, each step dict
becomes a chunk per completion that got something new in it (`deltas`); not streamed, each
prompt's last dict makes the answer. Errors have OpenAI's body,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request, 404 for an unknown model
or path, 405 for a wrong method, 413 for a body over the limit, 503 until the engine is ready
and for requests cut off by its stopping, 500 for anything else (a failed step, a fault: logged
with its traceback, and the server goes on).

The two generation endpoints are plain Starlette routes, the lean path through the stack: their
body is parsed and checked by pydantic in one call (`model_validate_json`), not by FastAPI's
request layers, and a stream is Starlette's response without the anyio task group it starts
per request to listen for the client's leaving (the request's queue hears of that instead:
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
from starlette.exceptions import HTTPException
from transformers.convert_slow_tokenizer import bytes_to_unicode

from nanograph import LoRARequest
from nanograph.serve.engine_thread import EngineError, EngineThread, Job
from nanograph.serve.protocol import ChatRequest, CompletionRequest, StreamOptions

TOKENIZE_IN_THREAD_BYTES = 65536   # a body this large is tokenized in a worker thread
BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's map


class APIError(Exception):
    def __init__(self, status: int, message: str, param=None, code=None):
        self.body = {"error": {"message": message,
                               "type": "invalid_request_error" if status < 500 else "server_error",
                               "param": param,
                               "code": code}}
        self.response = JSONResponse(self.body, status_code=status)


def create_app(engine: EngineThread, served_model: str, loras: dict[str, LoRARequest],
               max_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="nanograph")

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, error: EngineError):
        return APIError(error.status, str(error)).response

    @app.exception_handler(HTTPException)  # Starlette's own: an unknown path, a wrong method
    @app.exception_handler(Exception)  # a fault (Starlette logs its traceback after this)
    async def other_error(request: Request, error: Exception):
        if isinstance(error, HTTPException):
            return APIError(error.status_code, error.detail).response
        return APIError(500, f"internal error: {error!r}").response

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
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "nanograph"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name) for name in [served_model, *loras]]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        adapter(name)  # (404 if unknown)
        return card(name)

    def adapter(model: str | None) -> LoRARequest | None:
        """The LoRA adapter that `model` names; None for the served model itself."""
        if model is None or model == served_model:
            return None
        if model not in loras:
            raise APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")
        return loras[model]

    async def read_body(request: Request) -> bytes:
        """The body; a 413 once it is past the limit (the rest is never read)."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f"the request body is over {max_body_bytes} bytes "
                                    "(the server's --max-request-body-bytes)")
        return bytes(body)

    async def generate(kind: type[CompletionRequest | ChatRequest], request: Request):
        raw = await read_body(request)
        body = kind.model_validate_json(raw)
        check_ready()
        lora = adapter(body.model)
        prepare = partial(body.prepare, engine.tokenizer, engine.llm.config.max_model_len)
        try:
            params, prompts = (await asyncio.to_thread(prepare)
                               if len(raw) > TOKENIZE_IN_THREAD_BYTES else prepare())
            queue = asyncio.Queue()  # the request's: every prompt's outputs, tagged
            jobs = [Job(params, prompt, index=index, lora=lora, queue=queue)
                    for index, prompt in enumerate(prompts)]
            outputs = engine.generate(jobs)
            await anext(outputs)  # the engine has taken them
        except ValueError as e:
            raise APIError(400, str(e)) from None
        echo = body.prompts() if kind is CompletionRequest and body.echo else None
        reply = Reply(kind is ChatRequest, body.model or served_model, engine.tokenizer,
                      params.logprobs, params.n, echo)
        # The client's leaving ends its outputs (their finally aborts the request): once the body
        # is read, uvicorn's receive() returns when the connection closes (or the response ends).
        # (The task lives on as a waiter of uvicorn's event, until then.)
        gone = asyncio.ensure_future(request.receive())
        gone.add_done_callback(lambda _: queue.put_nowait((0, ClientGone("the client left"))))
        if body.stream:
            return EventStream(reply.events(outputs, body.stream_options or StreamOptions()))
        last = [None] * len(jobs)  # each prompt's last step dict
        async for index, out in outputs:
            last[index] = out
        return JSONResponse(reply.whole(last))

    # (plain Starlette routes: the module docstring says why)
    app.add_route("/v1/completions", partial(generate, CompletionRequest), methods=["POST"])
    app.add_route("/v1/chat/completions", partial(generate, ChatRequest), methods=["POST"])
    return app


class ClientGone(EngineError):
    """Put in a request's queue when its client has closed the connection: its outputs end,
    and the error that answers it (a 500, or an error event) goes nowhere."""


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
    tokenizer: object        # for the logprobs' token strings (None: "token_id:N")
    top_logprobs: int | None
    n: int                   # completions per prompt
    echo: list[str | list[int]] | None  # completions' echo: the prompts, before their choices
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, stream: bool) -> dict:
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}", "object": kind,
                "created": self.created, "model": self.model}

    def whole(self, outs: list[dict]) -> dict:
        """The answer from each prompt's finished step dict."""
        return {**self.head(stream=False),
                "choices": [self.choice(index * self.n + i, c, out, stream=False, first=True)
                            for index, out in enumerate(outs)
                            for i, c in enumerate(out["outputs"])],
                "usage": usage(outs)}

    async def events(self, outputs, options: StreamOptions):
        """Server-sent events: chunks as the steps come (with usage on each if
        `continuous_usage_stats`), a usage chunk if `include_usage`, then `data: [DONE]`."""
        sent = {}  # prompt index -> the step dict its chunks so far came from
        try:
            async for index, out in outputs:
                first = index not in sent
                for i, new in deltas(sent.get(index), out):
                    chunk = {**self.head(stream=True),
                             "choices": [self.choice(index * self.n + i, new, out, stream=True,
                                                     first=first)]}
                    if options.continuous_usage_stats:
                        chunk["usage"] = usage({**sent, index: out}.values())
                    yield sse(chunk)
                sent[index] = out
            if options.include_usage:
                yield sse({**self.head(stream=True), "choices": [], "usage": usage(sent.values())})
        except EngineError as e:  # the status line has gone: the error is an event
            yield sse(APIError(e.status, str(e)).body)
        yield "data: [DONE]\n\n"

    def choice(self, index: int, c: dict, out: dict, stream: bool, first: bool) -> dict:
        """Completion dict `c` of step dict `out` (whole, or its new part) as choice `index`."""
        text = c["text"] or ""  # (None: the model has no tokenizer)
        token_ids, tops = c["token_ids"], c["logprobs"]
        if self.echo is not None and first:  # echo: the prompt goes first
            prompt = self.echo[index // self.n]
            text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) + text
            token_ids = out["prompt_token_ids"] + token_ids
            tops = None if tops is None else out["prompt_logprobs"] + tops
        message = {"role": "assistant", "content": text}
        if not self.chat:
            content = {"text": text}
        elif stream:
            content = {"delta": message if first else {"content": text}}
        else:
            content = {"message": message}
        return {"index": index,
                **content,
                "logprobs": None if tops is None else self.logprobs(token_ids, tops),
                "finish_reason": c["finish_reason"],
                "stop_reason": c["stop_reason"]}

    def logprobs(self, token_ids: list[int], tops: list[dict | None]) -> dict:
        """OpenAI's logprobs of `token_ids`, from their {token id: logprob} entries (the top N
        and the token's own; None for an echoed prompt's first token): chat's entries with their
        top N, or completions' three lists."""
        sampled = [self.entry(t, top and top[t]) for t, top in zip(token_ids, tops)]
        ranked = [top and sorted(top.items(), key=lambda tp: -tp[1]) for top in tops]
        if self.chat:
            return {"content": [{**entry, "top_logprobs": [self.entry(token_id, logprob)
                                                           for token_id, logprob
                                                           in best[:self.top_logprobs]]}
                                for entry, best in zip(sampled, ranked)]}
        return {"tokens": [entry["token"] for entry in sampled],
                "token_logprobs": [entry["logprob"] for entry in sampled],
                "top_logprobs": [best and self.top_dict(best) for best in ranked]}

    def top_dict(self, ranked: list[tuple[int, float]]) -> dict[str, float]:
        """Completions' {token: logprob}; a token whose text an earlier one has is named by its
        id ("token_id:N"), so that no entry is lost."""
        top = {}
        for token_id, logprob in ranked:
            token = self.entry(token_id, logprob)["token"]
            top[f"token_id:{token_id}" if token in top else token] = logprob
        return top

    def entry(self, token_id: int, logprob: float | None) -> dict:
        """A token's text and bytes: a piece of a character (a byte-level token) is its bytes,
        and its text names them (OpenAI's "bytes:\\xe6")."""
        data = token_bytes(self.tokenizer, token_id)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)
        return {"token": text, "logprob": logprob, "bytes": list(data)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for. Decoded alone, a token that holds part of a character is
    U+FFFD; its bytes are then in its vocabulary entry: `<0xE6>` (SentencePiece's byte fallback),
    or one character a byte (byte-level BPE's map)."""
    if tokenizer is None:  # (the model has none)
        return f"token_id:{token_id}".encode()
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece.startswith("<0x") and piece.endswith(">"):
        return bytes.fromhex(piece[3:-1])
    if all(char in BYTE_OF_CHAR for char in piece):
        return bytes(BYTE_OF_CHAR[char] for char in piece)
    return text.encode()


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


def usage(outs) -> dict:
    """Token counts over step dicts `outs` (a request's prompts)."""
    prompt = sum(len(out["prompt_token_ids"]) for out in outs)
    completion = sum(len(c["token_ids"]) for out in outs for c in out["outputs"])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
