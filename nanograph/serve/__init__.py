"""An OpenAI-compatible HTTP server (and a terminal chat) over one LLM, in one process.

    python -m nanograph.serve MODEL [--port 8000] [--shell] [every LLM knob as --kebab-case]

Two threads, two kinds of queue. An LLM is driven by one thread (llm.py), and its step loop
must not wait on the network, so the LLM gets a thread of its own, the engine thread; the HTTP
side (FastAPI on uvicorn) is an asyncio event loop in the main thread:

    HTTP handler (event loop)                        engine thread (owns the LLM)
    ------------------------------------------       -------------------------------------------
    body -> SamplingParams, token ids (400 if bad)
    inbox.put(("add", jobs))     ---queue.Queue--->  add_request (400 if it raises ValueError)
    await job.queue.get()                            step(); a request's dicts, as they come:
          ^----asyncio.Queue <- loop.call_soon_threadsafe(job.queue.put_nowait, dict)
    each dict -> one SSE chunk (stream) or, the last one, the whole answer
    client gone: inbox.put(("abort", jobs)) ------>  abort_request: its blocks are free at once

The handler tokenizes the prompt (in a worker thread if the body is large): the engine thread
does no request's text work, so a long prompt stalls no stream. A request's prompts (a list is
several) are a Job each, sent as one message and taken all or none. The engine thread blocks on
its inbox while nothing is unfinished, so an idle server costs nothing; while requests run it
takes what has arrived between two steps without waiting. The first thing a request's queue
receives is that its jobs were taken, or the error that refused them (a ValueError: its 400;
anything else: its 500, logged; the engine goes on): the handler learns whether the request is
valid before it answers, so a bad request is a 400, never a stream that starts and then fails.
After that come the step dicts, whose `text` and `token_ids` are the whole completion so far; a
stream sends what is new since the last chunk.

The two threads share the GIL, and the engine thread is busy in Python for much of a step
(scheduling, launching, reading the sampled tokens): the event loop runs where the engine thread
lets go of it. So after each step the engine thread yields it on purpose (`time.sleep(0)`): the
chunks it has just handed over go out before its next step's Python work, not in the gaps of it.

A client that goes away is noticed through its job's queue. Once the body is read, a small task
awaits uvicorn's `receive()`, which returns only when the connection closes (or the response has
ended), and then puts ClientGone (an EngineError) in the queue: the job's outputs end with it as
with any error, their `finally` sends ("abort", job), and the error's answer goes nowhere. A
failed step is answered to every request in it (a 500, or an error event in a stream) and the
engine takes new requests, unless the failure closed it (a tensor-parallel worker died): then
the engine thread ends (/health fails first, open requests get 503) and the server exits with
status 1, saying why.

Readiness: uvicorn opens the port at once while the engine thread builds the LLM (weights, KV
cache, CUDA graph capture). Until the build is done `/health` and the generation endpoints
answer 503; a load balancer's readiness probe sends no traffic before the graphs are warm.
SIGTERM (or Ctrl-C) stops the engine first, which ends every open stream, then uvicorn, and the
engine thread closes the LLM (and its tensor-parallel workers) on its way out.

Files: engine_thread.py (the thread and the queues), protocol.py (request bodies), api.py (the
endpoints and OpenAI's response formats), metrics.py (Prometheus), shell.py (the terminal chat),
cli.py (flags, start-up, shutdown). The engine package imports none of them.
"""
