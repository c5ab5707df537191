"""The engine thread: owns the LLM, takes jobs from a queue.Queue, answers on their asyncio.Queues.

Messages in the inbox, in the order the event loop sent them: ("add", jobs), ("abort", jobs) and
("stop", None), where `jobs` are one HTTP request's prompts, a Job each, taken all or none. Their
shared queue receives (prompt index, item) pairs: first None (taken) or the error that refused
them, then the LLM's step dicts up to each one's finished dict, or an EngineError instead if a
step fails or the server stops. An error in one request is that request's answer alone: a
ValueError is its 400, anything else its 500 (logged, with the traceback); the engine goes on.
The package docstring (__init__.py) draws the whole exchange.
"""
import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from nanograph import LLM, LoRARequest, SamplingParams
from nanograph.serve.metrics import Metrics

logger = logging.getLogger("nanograph.serve")


class EngineError(RuntimeError):
    """The engine could not finish a request: a fault (its answer is a 500)."""
    status = 500


class EngineStopped(EngineError):
    """The engine stopped (the server shuts down, or the engine failed) with the request open."""
    status = 503


@dataclass
class Job:
    """One prompt of a request on its way through the engine thread. Made on the event loop."""
    params: SamplingParams
    prompt: list[int]                        # token ids: the handler has tokenized it
    index: int = 0                           # its place among the request's prompts
    lora: LoRARequest | None = None
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (the request's, shared)
    arrival: float = field(default_factory=time.perf_counter)
    # the engine thread's: the LLM's id for it, and what the metrics need
    request_id: int | None = None
    num_tokens: int = 0
    last_token_time: float = 0.0

    def put(self, item):
        """From the engine thread: hand `item` to the job's queue, on the event loop's thread."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))


class EngineThread:
    def __init__(self, model: str, knobs: dict, served_model: str):
        self.inbox = queue.Queue()
        self.ready = threading.Event()   # set once the LLM is built and its graphs captured
        self.error = None                # why the engine stopped, if it failed
        self.on_exit = lambda: None      # called when the thread ends (the server exits then)
        self.metrics = Metrics(served_model)
        self.llm = None
        self.tokenizer = None            # the event loop's own copy (prompts, logprobs' tokens)
        self.jobs = {}                   # Job by request id, until their finished dict
        self.queued = {}                 # ... until the scheduler first takes them
        self.thread = threading.Thread(target=self.run, args=(model, knobs),
                                       name="nanograph-engine", daemon=True)

    # ---- the event loop's side --------------------------------------------------------------
    async def generate(self, jobs: list[Job]):
        """Hand one request's `jobs` (sharing one queue) to the engine (only while `ready` is
        set). Yields (0, None) once it has taken them all, or raises the error that refused
        them; then (prompt index, step dict) as they come."""
        self.inbox.put(("add", jobs))
        unfinished = len(jobs)
        try:
            while unfinished:
                index, item = await jobs[0].queue.get()
                if isinstance(item, Exception):
                    raise item
                unfinished -= item is not None and item["finished"]
                yield index, item
        finally:  # the consumer stopped early (a client gone): free their blocks now
            if unfinished:
                self.inbox.put(("abort", jobs))

    def stop(self):
        self.ready.clear()  # no new requests (and /health says 503 to the load balancer)
        self.inbox.put(("stop", None))

    # ---- the engine thread ------------------------------------------------------------------
    def run(self, model: str, knobs: dict):
        try:
            self.llm = LLM(model, **knobs)
            self.tokenizer = copy.deepcopy(self.llm.tokenizer)
            self.metrics.watch(self.llm)
            self.metrics.update(self.llm, time.perf_counter())
            self.ready.set()
            logger.info("engine ready: %s", model)
            while self.take_messages(block=not self.llm.has_unfinished_requests()):
                if self.llm.has_unfinished_requests():
                    self.step()
                    time.sleep(0)  # the GIL to the event loop, for the chunks just handed over
        except Exception as e:
            logger.exception("the engine failed")
            self.error = f"the engine failed: {e!r}"
        finally:  # /health fails first; every request still open is cut off with a 503
            self.ready.clear()
            error = EngineStopped(self.error or "the server is shutting down")
            while not self.inbox.empty():
                kind, jobs = self.inbox.get()
                if kind == "add":
                    jobs[0].put(error)
            self.fail_jobs(error)
            if self.llm is not None:
                self.llm.close()
            self.on_exit()

    def take_messages(self, block: bool) -> bool:
        """Add and abort what the event loop sent (waiting for a message if `block`).
        False: stop."""
        while True:
            try:
                kind, jobs = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "abort":
                for job in jobs:
                    self.llm.abort_request(job.request_id)  # (ignored if it has finished)
            else:
                self.add(jobs)

    def add(self, jobs: list[Job]):
        """Add a request's prompts, all or none."""
        try:
            for job in jobs:
                job.request_id = self.llm.add_request(job.prompt, job.params, job.lora)
        except Exception as e:
            if not isinstance(e, ValueError):  # not the request's fault: its 500
                logger.exception("the engine could not take a request")
                e = EngineError(f"the engine could not take the request: {e!r}")
            for job in jobs:  # (the next step reports them aborted, to nobody)
                self.llm.abort_request(job.request_id)  # (None, for those not added: ignored)
            jobs[0].put(e)
            return
        for job in jobs:
            self.jobs[job.request_id] = self.queued[job.request_id] = job
        jobs[0].put(None)

    def step(self):
        started = time.perf_counter()
        try:
            outputs = self.llm.step()
        except Exception as e:  # the LLM has aborted everything in flight
            logger.exception("a step failed; its requests get an error")
            self.fail_jobs(EngineError(f"the engine step failed: {e!r}"))
            if self.llm.runner.model is None:  # the failure closed the LLM: the thread ends
                raise
            return
        now = time.perf_counter()
        self.metrics.update(self.llm, now)  # first: a client that sees its end sees them after it
        self.record_queue_times(started)
        for out in outputs:
            job = self.jobs.get(out["request_id"])
            if job is None:  # refused with the rest of its request
                continue
            self.metrics.record(job, out, now)
            job.put(out)
            if out["finished"]:
                del self.jobs[out["request_id"]]

    def record_queue_times(self, step_start: float):
        """The requests the scheduler took in this step waited since their arrival."""
        for request_id, job in list(self.queued.items()):
            request = self.llm.requests.get(request_id)
            if request is None or request.seqs[0].num_computed_tokens:
                self.metrics.queue_time.observe(step_start - job.arrival)
                del self.queued[request_id]

    def fail_jobs(self, error: EngineError):
        for job in self.jobs.values():
            job.put(error)
        self.jobs.clear()
        self.queued.clear()
