"""ModelRunner: owns the model and the KV cache on one device, and runs one step at a time.

A step goes: the scheduler's `Batch` -> `StepInput` -> the static `StepBuffers` (step.py) ->
`forward` on them, replayed from a CUDA graph where one holds the step (cuda_graph.py), else
run eagerly with the step's exact shape: the same code either way -> logits of each sampling
row's token -> sampled ids. It is split in two halves so the host never waits inside a step:
- `launch` queues all of that on the GPU and returns at once: the inputs go up with one
  non-blocking copy from pinned memory, the sampled ids stay on the device (in `sampled`,
  where the next step's placeholders are resolved) and start a non-blocking copy back into a
  pinned host tensor, followed by an event. The sampler runs inside `forward`; only a step with
  a row that asks for top-k / top-p or a min_tokens mask samples again on the logits after it,
  and only one that asks for logprobs computes them (layers/sampler.py).
- `collect` waits for that event and returns the ids (and logprobs) as lists.
Between the two the host is free: llm.py schedules and launches the next step there. Nothing in
`launch` may synchronise with the GPU, or the overlap silently disappears: a `torch.tensor(list,
device="cuda")` does (a pageable copy waits for the stream), hence `upload`.

KV cache: one tensor [2, layers, blocks, block_size, kv_heads, head_dim], each layer's
Attention holding views into it. Its size comes from memory: on CUDA, what is left of
`gpu_memory_utilization` after the weights and the activation peak of the largest prefill
(measured by a warm-up run); on the CPU a modest 1 GiB at most.

Tensor parallelism (engine/tp.py) runs a subclass on each rank: its own GPU, the model cut into
the rank's share by an extension installed first, and the smallest rank's block count.

Extensions (`RunnerExtension`, handed in by llm.py) change the runner from outside at four points:
`install` swaps modules into the model once its weights are loaded (before the cache is sized and
the graphs captured); `step_fields` and `graph_variants` add fields to the static buffers and
variants to the graphs (cuda_graph.py), `graph_shapes` graphs of its own steps' shapes and
`max_rows` the sampling rows they need; `before_step` runs on the host before a step's inputs go up;
`bind` runs inside `forward`, so inside every captured graph, and hands an extension its views of
the buffers. The runner calls them there and knows nothing else of them.
"""
import math
from dataclasses import dataclass

import torch

from nanograph.config import Config
from nanograph.engine.cuda_graph import MIXED_PREFILL_CHUNKS, CudaGraphRunner
from nanograph.engine.scheduler import Batch
from nanograph.engine.step import (StepBuffers, StepInput, StepShape, build_step,
                                   resolve_placeholders)
from nanograph.layers.sampler import Logprobs, sample, sample_softmax, top_logprobs
from nanograph.models.decoder import DecoderForCausalLM
from nanograph.utils.context import AttentionInputs, StepMetadata, set_step_metadata
from nanograph.utils.loader import init_dummy_weights, load_weights

CPU_KV_CACHE_BYTES = 1 << 30
PROMPT_LOGPROB_ROWS = 512  # prompt tokens scored at once (a [rows, vocab] float32 table)


class RunnerExtension:
    """What an extension adds to the runner (see above); each hook here does nothing."""
    step_fields: dict[str, tuple[str, int]] = {}  # more buffer fields: name -> (per, padding)
    graph_variants: tuple[int, ...] = ()  # graphs captured again for each (cuda_graph.py)
    graph_shapes: tuple[StepShape, ...] = ()  # more graphs, for prefill-only shapes
    max_rows: int = 0  # the most sampling rows its steps have

    def install(self, model: torch.nn.Module):
        """Swap modules into the model, once its weights are loaded."""

    def before_step(self, step: StepInput) -> dict[str, list]:
        """Host side, before the step's inputs go up: the values of its `step_fields`."""
        return {}

    def bind(self, inputs: dict[str, torch.Tensor], shape: StepShape):
        """In `forward`, before the model: the step's shape and its views of the buffers."""


@dataclass
class InFlight:
    """A launched step. Its host copies are complete once `done` has passed."""
    batch: Batch
    step: StepInput
    sampled_ids: torch.Tensor          # [rows], on the host
    logprobs: Logprobs | None          # on the host, when some row asked for them
    prompt_logprobs: Logprobs | None   # on the host, when some prompt token's are asked for
    done: torch.cuda.Event | None      # None on the CPU, where the copies are synchronous


def logprob_dicts(tokens: list[int], logprobs: Logprobs, top_n: list[int]) -> list[dict]:
    """{token id: logprob} for each token: its first top_n[i] most likely tokens' and its own."""
    own, top_values, top_ids = (t.tolist() for t in logprobs)
    dicts = []
    for i, token in enumerate(tokens):
        count = max(top_n[i], 0)
        dicts.append(dict(zip(top_ids[i][:count], top_values[i][:count])) | {token: own[i]})
    return dicts


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy into (pinned) host memory, without waiting for the GPU; on the CPU a copy too, since
    the ids there are a view of the buffers."""
    return tensor.to("cpu", non_blocking=True, copy=True)


class ModelRunner:
    def __init__(self, config: Config, extensions: list[RunnerExtension] = ()):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.kvcache_block_size
        default_dtype = torch.get_default_dtype()
        # build the weights in their final dtype directly
        torch.set_default_dtype(config.torch_dtype)
        with torch.device(self.device):
            self.model = DecoderForCausalLM(config.hf_config)
        torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model_dir)
        self.extensions = list(extensions)
        for extension in self.extensions:
            extension.install(self.model)
        self.attention_layers = [layer.self_attn.attn for layer in self.model.model.layers]
        for attn in self.attention_layers:
            attn.backend = config.attention_backend
        first = self.model.model.layers[0].self_attn
        # one cache block of one layer: [block_size, kv_heads on this rank, head_dim]
        self.kv_block_shape = (self.block_size, first.num_kv_heads, first.head_dim)
        # the static step buffers and outputs, for the largest step: eager or a graph's (padded)
        max_rows = max([config.max_num_seqs + MIXED_PREFILL_CHUNKS]
                       + [extension.max_rows for extension in self.extensions])
        max_blocks = -(-config.max_model_len // self.block_size)
        extra_fields = {name: spec for extension in self.extensions
                        for name, spec in extension.step_fields.items()}
        self.buffers = StepBuffers(config.max_num_batched_tokens + max_rows, max_rows, max_blocks,
                                   self.device, extra_fields)
        vocab = config.hf_config.vocab_size
        self.logits = torch.empty(max_rows, vocab, dtype=config.torch_dtype, device=self.device)
        self.sampled = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        # "no graphs" has one spelling: this stays None (run works before capture)
        self.graphs = None
        self.num_kv_blocks = self.allocate_kv_cache()
        # the torch backend (the oracle) reads lengths on the host: it cannot be captured
        capturable = self.device.type == "cuda" and config.attention_backend != "torch"
        if capturable and not config.enforce_eager and config.cuda_graph_max_bs != 0:
            variants = [v for extension in self.extensions for v in extension.graph_variants]
            shapes = [s for extension in self.extensions for s in extension.graph_shapes]
            self.graphs = CudaGraphRunner(config, self.forward, self.buffers, variants, shapes)

    # ---- KV cache ------------------------------------------------------------------------
    def allocate_kv_cache(self):
        num_blocks = self.count_kv_blocks()
        if num_blocks < 1:
            raise ValueError("no memory for the KV cache: lower max_num_batched_tokens or "
                             "raise gpu_memory_utilization")
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def count_kv_blocks(self) -> int:
        """How many blocks the KV cache gets: `num_kvcache_blocks`, or what memory allows."""
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        block_bytes = 2 * len(self.attention_layers) * self.config.kv_cache_torch_dtype.itemsize \
            * math.prod(self.kv_block_shape)
        if self.device.type == "cuda":
            peak = self.measure_activation_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.gpu_memory_utilization - (total - free) - peak
            return int(budget // block_bytes)
        needed = self.config.max_num_seqs * self.buffers.max_blocks
        return min(needed, CPU_KV_CACHE_BYTES // block_bytes)

    def bind_kv_cache(self, num_blocks):
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, *self.kv_block_shape,
                                    dtype=self.config.kv_cache_torch_dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]

    def measure_activation_peak(self):
        """Run the largest prefill the scheduler can send once and return the activation memory it
        peaked at: the shape decides the memory, so its rows are all padding (no K/V written)."""
        tokens = self.config.max_num_batched_tokens
        chunks = max(1, min(self.config.max_num_seqs, tokens // self.config.max_model_len))
        shape = StepShape(decodes=0,
                          prefill_tokens=tokens,
                          chunks=chunks,
                          rows=chunks,
                          max_chunk=tokens // chunks)
        self.bind_kv_cache(1)
        self.buffers.fill(StepInput(), shape)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.forward(shape)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.bind_kv_cache(0)
        torch.cuda.empty_cache()
        return peak

    # ---- one step --------------------------------------------------------------------------
    def upload(self, data, dtype: torch.dtype):
        """A host list on the device without waiting for the GPU (pinned memory, non-blocking
        copy)."""
        pinned = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return pinned.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, shape: StepShape):
        """The step laid out by `shape` in the static buffers: the model, then the logits and
        sampled ids of its sampling rows (into `self.logits` / `self.sampled`, where the next step's
        placeholders find them). What a CUDA graph records and replays."""
        inputs = self.buffers.views(shape)
        decodes = slice(0, shape.decodes)  # the decode part, then the prefill part
        chunks = slice(shape.decodes, None)
        slots, lens, tables = inputs["slot_mapping"], inputs["context_lens"], inputs["block_tables"]
        md = StepMetadata(num_decodes=shape.decodes, slot_mapping=slots)
        if shape.decodes:
            md.decode = AttentionInputs(slots[decodes], lens[decodes], tables[decodes])
        if shape.prefill_tokens:
            md.prefill = AttentionInputs(slots[chunks], lens[chunks], tables[chunks],
                                         inputs["cu_seqlens_q"], shape.max_chunk)
        set_step_metadata(md)
        for extension in self.extensions:
            extension.bind(inputs, shape)
        input_ids = resolve_placeholders(inputs["input_ids"], self.sampled)
        hidden = self.model(input_ids, inputs["positions"])
        set_step_metadata(None)
        # only the tokens that sample go through the LM head
        sampling = hidden[inputs["sample_indices"]] if shape.prefill_tokens else hidden
        rows = shape.rows
        self.logits[:rows] = self.model.lm_head(sampling)
        self.sampled[:rows] = sample_softmax(self.logits[:rows], inputs["temperatures"],
                                             inputs["seeds"], inputs["sample_lens"])
        return hidden

    @torch.inference_mode()
    def run(self, step: StepInput):
        """The logits [rows, vocab] and sampled ids [rows] of the step's sampling rows (the ids
        stay in `self.sampled` for the next step's placeholders), and its prompt logprobs when
        asked. Every tensor-parallel rank runs this and samples the same ids."""
        extra_values = {}
        for extension in self.extensions:
            extra_values |= extension.before_step(step)
        exact = step.exact_shape()
        bucket = None
        # (prompt logprobs need every token's hidden state, which a graph keeps to itself)
        if self.graphs is not None and not step.prompt_logprob_indices:
            bucket = self.graphs.lookup(exact)
        shape = bucket or exact
        self.buffers.fill(step, shape, extra_values)
        prompt_logprobs = None
        if bucket is not None:
            self.graphs.replay(bucket, exact)
        else:
            hidden = self.forward(shape)
            if step.prompt_logprob_indices:
                prompt_logprobs = self.score_prompt(step, hidden)
        logits, sampled = self.logits[:exact.rows], self.sampled[:exact.rows]
        if step.top_ks is not None or step.banned:  # the filters the forward leaves out
            sampled = self.resample(step, shape, logits)
        return logits, sampled, prompt_logprobs

    def score_prompt(self, step: StepInput, hidden: torch.Tensor) -> Logprobs:
        """Each asked-for prompt token's log-probability given the tokens before it, and the top
        N's: from the raw logits, as vLLM reports them, PROMPT_LOGPROB_ROWS tokens at a time."""
        indices = self.upload(step.prompt_logprob_indices, torch.int64)
        targets = self.upload(step.prompt_logprob_targets, torch.int64)
        top_n = max(step.prompt_logprob_top_n)
        parts = [top_logprobs(self.model.lm_head(hidden[rows]), row_targets, top_n)
                 for rows, row_targets in zip(indices.split(PROMPT_LOGPROB_ROWS),
                                              targets.split(PROMPT_LOGPROB_ROWS))]
        return Logprobs(*(torch.cat(column) for column in zip(*parts)))

    def resample(self, step: StepInput, shape: StepShape, logits: torch.Tensor):
        """Sample the step's rows again, after top-k / top-p and the min_tokens mask (the graph's
        sampler has none of them); the new ids replace the graph's in `self.sampled`."""
        rows = len(logits)
        inputs = self.buffers.views(shape)
        top = banned = None
        if step.top_ks is not None:
            top = (self.upload(step.top_ks, torch.int64), self.upload(step.top_ps, torch.float32))
        if step.banned:
            banned = tuple(self.upload(step.banned, torch.int64).T)
        self.sampled[:rows] = sample(logits, inputs["temperatures"][:rows], inputs["seeds"][:rows],
                                     inputs["sample_lens"][:rows], top, banned)
        return self.sampled[:rows]

    @torch.inference_mode()
    def launch(self, batch: Batch) -> InFlight:
        step = build_step(batch, self.block_size)
        logits, sampled, prompt_logprobs = self.run(step)
        logprobs = None
        if step.num_logprobs is not None:
            top = top_logprobs(logits, sampled, max(step.num_logprobs))
            logprobs = Logprobs(*map(to_host, top))
        if prompt_logprobs is not None:
            prompt_logprobs = Logprobs(*map(to_host, prompt_logprobs))
        sampled = to_host(sampled)
        # (after every copy to the host: `collect` waits for it)
        done = torch.cuda.current_stream().record_event() if self.device.type == "cuda" else None
        return InFlight(batch, step, sampled, logprobs, prompt_logprobs, done)

    @staticmethod
    def collect(launched: InFlight):
        """The step's sampled ids; when some row asked, each row's {token id: logprob}: its top N
        and the sampled token's (a row that did not ask gets the sampled token's alone); and the
        asked-for prompt tokens' {token id: logprob}, the same way."""
        if launched.done is not None:
            launched.done.synchronize()
        step = launched.step
        ids = launched.sampled_ids.tolist()
        logprobs = prompt_logprobs = None
        if launched.logprobs is not None:
            logprobs = logprob_dicts(ids, launched.logprobs, step.num_logprobs)
        if launched.prompt_logprobs is not None:
            entries = logprob_dicts(step.prompt_logprob_targets, launched.prompt_logprobs,
                                    step.prompt_logprob_top_n)
            prompt_logprobs = list(zip(step.prompt_logprob_positions, entries))
        return ids, logprobs, prompt_logprobs

    def close(self):
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = self.model = self.kv_cache = self.attention_layers = self.extensions = None
        self.buffers = self.logits = self.sampled = None
        torch.cuda.empty_cache()  # a no-op without CUDA
