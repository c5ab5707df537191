"""The engine thread: owns the LLM, takes jobs from a queue.Queue, answers on their asyncio.Queues.

Messages in the inbox, in the order the event loop sent them: ("add", job), ("abort", job) and
("stop", None). What a job's queue receives, in order: its request id or the ValueError that
refused it, then the LLM's step dicts up to the finished one, or an EngineError instead if a step
fails or the server stops. The package docstring (__init__.py) draws the whole exchange.
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
    """The engine could not finish a request: a failed step, or the server stopping."""


@dataclass
class Job:
    """One request on its way through the engine thread. Made on the event loop."""
    params: SamplingParams
    prompt: str | list[int] | None = None    # text or token ids; or
    messages: list[dict] | None = None       # a conversation, through the chat template
    chat_template_kwargs: dict | None = None
    lora: LoRARequest | None = None
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    # the engine thread's: the LLM's id for it, and what the metrics need
    request_id: int | None = None
    num_tokens: int = 0
    last_token_time: float = 0.0

    def put(self, item):
        """From the engine thread: hand `item` to the job's queue, on the event loop's thread."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineThread:
    def __init__(self, model: str, knobs: dict):
        self.inbox = queue.Queue()
        self.ready = threading.Event()   # set once the LLM is built and its graphs captured
        self.error = None                # why the engine stopped, if it failed
        self.on_exit = lambda: None      # called when the thread ends (the server exits then)
        self.metrics = Metrics()
        self.llm = None
        self.tokenizer = None            # the event loop's own copy (logprobs' token strings)
        self.jobs = {}                   # Job by request id, until their finished dict
        self.thread = threading.Thread(target=self.run, args=(model, knobs),
                                       name="nanograph-engine", daemon=True)

    # ---- the event loop's side --------------------------------------------------------------
    async def generate(self, job: Job):
        """Hand `job` to the engine (only while `ready` is set). Yields its request id first, or
        raises the ValueError that refused it; then its step dicts as they come."""
        self.inbox.put(("add", job))
        finished = False
        try:
            while not finished:
                item = await job.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = isinstance(item, dict) and item["finished"]
                yield item
        finally:  # the consumer stopped early (a client gone): free its blocks now
            if not finished:
                self.inbox.put(("abort", job))

    def wait_ready(self) -> bool:
        """Block until the LLM is built; False if the thread ended first (a failed build)."""
        while not self.ready.wait(timeout=0.1):
            if not self.thread.is_alive():
                return False
        return True

    def stop(self):
        self.ready.clear()  # no new requests (and /health says 503 to the load balancer)
        self.inbox.put(("stop", None))

    # ---- the engine thread ------------------------------------------------------------------
    def run(self, model: str, knobs: dict):
        try:
            self.llm = LLM(model, **knobs)
            self.tokenizer = copy.deepcopy(self.llm.tokenizer)
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
        finally:
            self.ready.clear()
            error = EngineError(self.error or "the server is shutting down")
            while not self.inbox.empty():
                kind, job = self.inbox.get()
                if kind == "add":
                    job.put(error)
            self.fail_jobs(error)
            if self.llm is not None:
                self.llm.close()
            self.on_exit()

    def take_messages(self, block: bool) -> bool:
        """Add and abort what the event loop sent (waiting for a message if `block`).
        False: stop."""
        while True:
            try:
                kind, job = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "abort":
                self.llm.abort_request(job.request_id)  # (ignored if it has finished)
            else:
                self.add(job)

    def add(self, job: Job):
        try:
            prompt = job.prompt
            if job.messages is not None:
                prompt = self.llm.chat_prompt(job.messages, job.chat_template_kwargs)
            job.request_id = self.llm.add_request(prompt, job.params, job.lora)
        except ValueError as e:
            job.put(e)
            return
        self.jobs[job.request_id] = job
        job.put(job.request_id)

    def step(self):
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
        for out in outputs:
            job = self.jobs[out["request_id"]]
            self.metrics.record(job, out, now)
            job.put(out)
            if out["finished"]:
                del self.jobs[out["request_id"]]

    def fail_jobs(self, error: EngineError):
        for job in self.jobs.values():
            job.put(error)
        self.jobs.clear()
