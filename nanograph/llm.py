"""LLM: the user-facing engine. Validates requests, runs the step loop, returns outputs.

The engine step API (vLLM's `LLMEngine` names): `add_request` validates a request (a ValueError
before any work) and queues its sequences; `step` runs one step and returns a dict for each
request that got tokens or finished in it; `abort_request` frees a request's blocks at once.
`generate` is built on them: add every request (nothing runs unless all are valid), step until
all have finished, return the outputs in input order. One thread drives an LLM: a second one
calling in while the first is inside gets a RuntimeError, not a corrupted batch.

The step loop overlaps the host and the GPU (`overlap_scheduling`, on by default with CUDA).
A step has a host part (schedule, build the inputs, fill the graph buffers, launch) and a GPU
part (copy in, forward, sample, copy the ids out), and then the host reads the ids (collect:
append them, check stops, free finished sequences). Done in order, each side idles while the
other works. Instead the loop launches step N+1 *before* collecting step N:

    host  | sched+launch N | collect N-1 | sched+launch N+1 | collect N | sched+launch N+2 | ...
    GPU   |      ...  step N-1  |           step N            |          step N+1          |

This works because step N+1 needs only one thing from step N that the host does not know in
advance, the token each continuing sequence just sampled, and that stays on the GPU: the
scheduler gives the sequence a placeholder for it, and the forward swaps it in on the device
(engine/step.py). Positions, cache slots, block tables and block allocation depend only on
how many tokens each sequence has, which the host does know. What is *not* overlapped: a step
whose batch cannot be scheduled until the step in flight is collected (its blocks are needed)
launches after that collect, and a prefill is launched like any step (its inputs are known).

The price is a one-step lag on stops that only the token reveals (EOS, stop ids, stop strings): the
sequence was already scheduled once more when its EOS comes back, so one token is computed and
dropped (`stats()["overlap_discarded_tokens"]`); it never reaches the output. Stops known in
advance (max_tokens, max_model_len) are never late. With `overlap_scheduling=False` the loop is
the same with the look-ahead set to 0: collect right after launch. Both give the same tokens.
On the CPU the "device" is the same cores as the host, so there is nothing to overlap: it is
off there by default.

Extensions. `install_extensions` is the one place that names them: LoRA (lora/) hands its slot
table to the scheduler and its runner extension to the runner; the batch-1 chain (fast/) is a
runner extension on CUDA; speculative decoding (spec/) replaces the scheduler with its own and
hands the runner its verify graphs (and is handed the `LLM` class, to build a draft model's
engine with, without importing this module); tensor parallelism (engine/tp.py) replaces the
runner. The rest of the engine calls them through the scheduler's and the runner's hooks and
imports none of them.
"""
import contextlib
import dataclasses
import threading
from collections import deque
from itertools import count
from pathlib import Path

import torch
import xxhash
from jinja2 import TemplateError
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanograph.config import Config
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.model_runner import InFlight, ModelRunner, RunnerExtension
from nanograph.engine.request import Request
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence
from nanograph.engine.tp import TensorParallelRunner
from nanograph.lora import LoRA, LoRARequest
from nanograph.sampling_params import SamplingParams
from nanograph.spec import Speculation


ManySamplingParams = SamplingParams | list[SamplingParams] | None  # one for all, or one each
ManyLoRARequests = LoRARequest | list[LoRARequest | None] | None


def install_extensions(config: Config) \
        -> tuple[LoRA | None, Speculation | None, list[RunnerExtension]]:
    """The extensions `config` asks for: LoRA and speculative decoding (None each when not asked
    for) and the runner's extensions, in the order they install (LoRA wraps the layers the
    batch-1 chain then runs)."""
    lora = spec = None
    extensions = []
    if config.speculative_config is not None:
        spec = Speculation(config, build_engine=LLM)  # (LLM: a draft model's engine)
        extensions.append(spec.runner_extension)
    if config.enable_lora:
        lora = LoRA(config.hf_config, config.max_loras, config.max_lora_rank)
        extensions.append(lora.runner_extension)
    if config.device.startswith("cuda"):
        from nanograph.fast import FastDecodeChain  # (Triton: only where CUDA is)
        extensions.append(FastDecodeChain())
    return lora, spec, extensions


def chat_prompt(tokenizer, conversation: list[dict],
                chat_template_kwargs: dict | None = None) -> list[int]:
    """A conversation's token ids: the tokenizer's chat template, with the assistant's turn
    opened. ValueError when there is no template, or it fails on the conversation (an unknown
    role, kwargs it does not take)."""
    if not getattr(tokenizer, "chat_template", None):  # (no tokenizer: None has none)
        raise ValueError("the model has no chat template: send a plain prompt instead")
    try:
        text = tokenizer.apply_chat_template(conversation,
                                             tokenize=False,
                                             add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    except (TemplateError, TypeError) as e:
        raise ValueError(f"the chat template failed on this conversation: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template has them


class LLM(contextlib.AbstractContextManager):  # `with LLM(...) as llm:` closes it at the end
    def __init__(self, model: str, **kwargs):
        self.config = config = Config(model, **kwargs)
        self.tokenizer = None
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
        if any(Path(config.model_dir, f).exists() for f in tokenizer_files):
            self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        self.lora, self.spec, extensions = install_extensions(config)
        if config.tensor_parallel_size > 1:
            self.runner = TensorParallelRunner(config, extensions)
        else:
            self.runner = ModelRunner(config, extensions=extensions)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        make_scheduler = Scheduler if self.spec is None else self.spec.scheduler
        self.scheduler = make_scheduler(self.block_manager,
                                        max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=config.max_num_batched_tokens,
                                        max_num_mixed_tokens=config.max_num_mixed_tokens,
                                        max_model_len=config.max_model_len,
                                        slots=self.lora and self.lora.slots)
        self.eos_ids = self._eos_ids()
        self.requests: dict[int, Request] = {}   # unfinished (and aborted, until reported), by id
        self.in_flight: deque[InFlight] = deque()
        self.request_ids = count()
        self.seq_ids = count()
        self.driver = threading.Lock()

    def _eos_ids(self) -> frozenset[int]:
        """From the model's config, its generation config and its tokenizer, whichever exist."""
        model_dir = self.config.model_dir
        gen = None  # (not False: a False among the ids would be token 0)
        if Path(model_dir, "generation_config.json").exists():
            gen = GenerationConfig.from_pretrained(model_dir)
        values = (self.config.hf_config.eos_token_id, gen and gen.eos_token_id,
                  self.tokenizer and self.tokenizer.eos_token_id)
        return frozenset(i for v in values if v is not None
                         for i in (v if isinstance(v, list) else [v]))

    def close(self):
        """Free the device memory (and with tensor parallelism, the workers) now, not at garbage
        collection: the next LLM sizes its KV cache from the memory it finds free."""
        self.lora = None  # (its runner extension holds the model's LoRA layers)
        if self.spec is not None:
            self.spec.close()  # (a draft model's engine)
        self.runner.close()

    def __exit__(self, *exc):
        self.close()

    @contextlib.contextmanager
    def driving(self):
        """One thread at a time inside generate / step / add_request / abort_request."""
        if not self.driver.acquire(blocking=False):
            raise RuntimeError("another thread is inside this LLM's generate or step: an LLM is "
                               "driven by one thread at a time (use its step API from that thread)")
        try:
            # released by close(), or by a failed tensor-parallel step
            if self.runner.model is None:
                raise RuntimeError("this LLM has been closed")
            yield
        finally:
            self.driver.release()

    # ---- request intake ---------------------------------------------------------------------
    def _tokenize(self, name: str, prompt) -> list[int]:
        """A prompt's token ids, checked against the model."""
        cfg = self.config
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{name}: text prompt but model {cfg.model!r} has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"{name}: a prompt must be a str or a list of int token ids "
                             "(one tokenized prompt is given to generate as [ids])")
        if not prompt:
            raise ValueError(f"{name}: empty prompt")
        vocab = cfg.hf_config.vocab_size
        if (bad := [t for t in prompt if not 0 <= t < vocab]):
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= cfg.max_model_len:
            raise ValueError(
                f"{name}: prompt has {len(prompt)} tokens, max_model_len={cfg.max_model_len} "
                "leaves no room to generate")
        return list(prompt)

    def _check_params(self, name: str, prompt: list[int], params: SamplingParams):
        """The request's sampling params against the model, the tokenizer and the cache."""
        cfg = self.config
        vocab = cfg.hf_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids or ()):
            raise ValueError(f"{name}: stop_token_ids {params.stop_token_ids} "
                             f"outside the vocabulary [0, {vocab})")
        if max(params.logprobs or 0, params.prompt_logprobs or 0) > vocab:
            raise ValueError(f"{name}: logprobs={params.logprobs}, prompt_logprobs="
                             f"{params.prompt_logprobs}: more than the vocabulary's {vocab}")
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"{name}: stop strings need a tokenizer, and model {cfg.model!r} has none")
        longest = min(len(prompt) + params.max_tokens, cfg.max_model_len)
        blocks = -(-longest // cfg.kvcache_block_size)  # one completion alone, at its longest
        if blocks > self.runner.num_kv_blocks:
            raise ValueError(
                f"{name}: needs up to {blocks} KV blocks ({longest} tokens) "
                f"but the cache has {self.runner.num_kv_blocks}; it could never run")

    def _make_request(self, name: str, prompt, params: SamplingParams | None,
                      lora_request: LoRARequest | None):
        """A validated request and its n sequences, queued; `name` for errors. Nothing is queued
        unless every check passes."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"{name}: sampling params must be a SamplingParams, got {type(params).__name__}")
        prompt = self._tokenize(name, prompt)
        if params.max_tokens is None:  # vLLM's meaning: up to the context
            params = dataclasses.replace(params, max_tokens=self.config.max_model_len - len(prompt))
        self._check_params(name, prompt, params)
        adapter = None
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"{name}: a lora_request needs LLM(..., enable_lora=True)")
            adapter = self.lora.adapter(name, lora_request)
        request_id = next(self.request_ids)
        stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.eos_ids)
        seqs = []
        for i in range(params.n):
            seq_id = next(self.seq_ids)
            seqs.append(Sequence(seq_id, prompt, params, self.config.kvcache_block_size,
                                 seed=self._noise_seed(params.seed, i, seq_id),
                                 stop_ids=stop_ids,
                                 request_id=request_id,
                                 adapter=adapter,
                                 cache_salt=0 if adapter is None else adapter.cache_salt))
        seqs[0].forks = seqs[1:]  # they start once the first has computed the prompt (scheduler.py)
        request = Request(request_id, prompt, seqs, self.tokenizer)
        self.scheduler.waiting.append(seqs[0])
        self.requests[request_id] = request
        return request

    def _noise_seed(self, seed: int | None, completion: int, seq_id: int) -> int:
        """Completion `completion`'s noise stream (layers/sampler.py), 31 bits: a hash of the
        request's whole seed and the completion's index, else of the engine's seed and the
        sequence's id."""
        if seed is None:
            return xxhash.xxh32_intdigest(b"%d" % seq_id, self.config.seed) & 0x7FFFFFFF
        return xxhash.xxh64_intdigest(b"%d:%d" % (seed, completion)) & 0x7FFFFFFF

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> int:
        """Queue a request (a str or token ids); returns its id. ValueError if it is bad."""
        with self.driving():
            return self._make_request("request", prompt, sampling_params, lora_request).request_id

    def abort_request(self, request_id: int):
        """Stop a request and free its blocks now; the next `step` reports it finished ("abort").
        An unknown or finished id is ignored."""
        with self.driving():
            for seq in self.requests[request_id].seqs if request_id in self.requests else ():
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_tokenizer(self):
        """The model's tokenizer (transformers'), None for a model without one."""
        return self.tokenizer

    # ---- running ----------------------------------------------------------------------------
    def step(self) -> list[dict]:
        """One step: a dict per request that got tokens or finished in it (Request.step_output)."""
        with self.driving():
            return [request.step_output() for request in self._step()]

    def _step(self):
        """Launch the next step, collect the oldest in flight; the requests that changed (and
        those aborted since the last step)."""
        changed = {i: r for i, r in self.requests.items() if r.finished}
        try:
            batch = self.scheduler.schedule()
            if batch is not None:
                self.in_flight.append(self.runner.launch(batch))
            # steps left in flight after a launch (none after one that must be collected first)
            lookahead = int(self.config.overlap_scheduling and (batch is None or batch.overlap))
            while len(self.in_flight) > lookahead or (batch is None and self.in_flight):
                launched = self.in_flight.popleft()
                for seq in self.scheduler.update(launched.batch, *self.runner.collect(launched)):
                    request = self.requests[seq.request_id]
                    changed[seq.request_id] = request
                    if (stop := request.update_text(seq)) is not None:
                        self.scheduler.finish(seq)  # (nothing if it finished already)
                        # a stop string outranks the length limit
                        seq.finish_reason, seq.stop_reason = "stop", stop
        except BaseException:  # nothing in flight can be trusted: every request ends, freed
            with contextlib.suppress(Exception):  # a broken device must not hide the original error
                torch.cuda.synchronize()  # (without CUDA this raises too: nothing to wait for)
            self.in_flight.clear()
            for request in self.requests.values():
                for seq in request.seqs:
                    self.scheduler.finish(seq, "abort")
            self.requests.clear()
            raise
        for request_id, request in changed.items():
            if request.finished:
                del self.requests[request_id]
        return list(changed.values())

    def generate(self, prompts, sampling_params: ManySamplingParams = None, use_tqdm: bool = True,
                 lora_request: ManyLoRARequests = None) -> list[dict]:
        with self.driving():
            if self.requests:
                raise RuntimeError(
                    f"{len(self.requests)} requests from add_request are unfinished: "
                    "step them to the end or abort them before generate")
            if isinstance(prompts, str):
                prompts = [prompts]  # one prompt, as vLLM takes it
            per_prompt = []  # the sampling params and the lora requests: one for all, or one each
            for name, value in (("sampling params", sampling_params),
                                ("lora requests", lora_request)):
                values = value if isinstance(value, list) else [value] * len(prompts)
                if len(values) != len(prompts):
                    raise ValueError(f"got {len(prompts)} prompts but {len(values)} {name}")
                per_prompt.append(values)
            try:  # every request is checked before any runs
                requests = [self._make_request(f"request {i}", *args)
                            for i, args in enumerate(zip(prompts, *per_prompt))]
            except BaseException:  # a bad request, or an interrupt: none of them stays queued
                self.scheduler.waiting.clear()
                self.requests.clear()
                raise
            with tqdm(total=len(requests),
                      desc="Generating",
                      disable=not use_tqdm,
                      dynamic_ncols=True) as bar:
                while self.requests or self.in_flight:
                    bar.update(sum(request.finished for request in self._step()))
            return [request.result() for request in requests]

    def chat(self, messages, sampling_params: ManySamplingParams = None, use_tqdm: bool = True,
             lora_request: ManyLoRARequests = None,
             chat_template_kwargs: dict | None = None) -> list[dict]:
        """generate() on conversations (one: a list of {"role", "content"} dicts; or a list of them)
        through the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt(self.tokenizer, conversation, chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def stats(self) -> dict:
        return {"prefix_cache_hit_tokens": self.block_manager.cache_hit_tokens,
                "preemptions": self.scheduler.num_preemptions,
                "overlap_discarded_tokens": self.scheduler.num_discarded_tokens,
                "steps": dict(self.scheduler.steps),
                "num_kvcache_blocks": self.runner.num_kv_blocks,
                "attention_backend": self.config.attention_backend,
                "kv_cache_dtype": str(self.config.kv_cache_torch_dtype).removeprefix("torch."),
                **(self.runner.graphs.stats_dict() if self.runner.graphs is not None else {}),
                **(self.lora.stats(self.runner.graphs) if self.lora is not None else {}),
                **(self.spec.stats(self.runner.graphs) if self.spec is not None else {})}
