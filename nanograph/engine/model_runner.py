"""ModelRunner: owns the model and the KV cache on one device, and runs one step at a time.

A step goes: the scheduler's `Batch` -> `StepInput` (step.py) -> tensors on the device ->
forward (eager, or a CUDA-graph replay for decode) -> logits of each sequence's last token ->
sampled token ids. It is split in two halves so the host never waits inside a step:
- `launch` queues all of that on the GPU and returns at once: the inputs go up with
  non-blocking copies from pinned memory, the sampled ids stay on the device (in the token
  table, where the next step's placeholders are resolved, step.py) and start a non-blocking
  copy back into a pinned host tensor, followed by an event. For a graph replay the sampler is
  inside the graph; only a batch that uses top-k / top-p samples after it (layers/sampler.py).
- `collect` waits for that event and returns the ids as a list.
Between the two the host is free: llm.py schedules and launches the next step there. Nothing in
`launch` may synchronise with the GPU, or the overlap silently disappears: a `torch.tensor(list,
device="cuda")` does (a pageable copy waits for the stream), hence `upload`.

KV cache: one tensor [2, layers, blocks, block_size, kv_heads, head_dim], each layer's
Attention holding views into it. Its size comes from memory: on CUDA, what is left of
`gpu_memory_utilization` after the weights and the activation peak of the largest prefill
(measured by a warm-up run); on the CPU a modest 1 GiB at most.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanograph.config import Config
from nanograph.engine.cuda_graph import MIXED_PREFILL_CHUNKS, CudaGraphRunner
from nanograph.engine.scheduler import Batch
from nanograph.engine.step import StepInput, TokenTable, build_step
from nanograph.layers.lora_slots import add_lora_buffers, load_adapter
from nanograph.layers.sampler import sample, top_logprobs
from nanograph.models.decoder import DecoderForCausalLM
from nanograph.utils.context import StepMetadata, set_step_metadata
from nanograph.utils.loader import init_dummy_weights, load_weights

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class InFlight:
    """A launched step. Its host copies are complete once `done` has passed."""
    batch: Batch
    tokens: torch.Tensor               # [rows] sampled ids
    done: torch.cuda.Event | None      # None on the CPU, where the copies are synchronous
    num_logprobs: list[int] | None = None   # per row (StepInput)
    logprobs: tuple | None = None      # (sampled token's [rows], top values, top ids [rows, N])


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and config.tensor_parallel_size > 1:
            self.device = torch.device("cuda", rank)  # one GPU per tensor-parallel rank
        self.block_size = config.kvcache_block_size
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)  # build the weights in their final dtype directly
        with torch.device(self.device):
            self.model = DecoderForCausalLM(config.hf_config)
        torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model_dir)
        if config.enable_lora:
            add_lora_buffers(self.model, config.max_loras, config.max_lora_rank)
        self.attention_layers = [layer.self_attn.attn for layer in self.model.model.layers]
        for attn in self.attention_layers:
            attn.backend = config.attention_backend
        first = self.model.model.layers[0].self_attn
        # one cache block of one layer: [block_size, kv_heads on this rank, head_dim]
        self.kv_block_shape = (self.block_size, first.num_kv_heads, first.head_dim)
        # a step's sampling rows: one per sequence, and a graph's padding
        max_rows = max(config.max_num_seqs, config.cuda_graph_max_bs or 0, *(config.cuda_graph_sizes or []))
        self.tokens = TokenTable(config.hf_config.vocab_size, max_rows + MIXED_PREFILL_CHUNKS, self.device)
        self.graphs = None  # "no graphs" has one spelling: this stays None (forward runs before capture)
        self.num_kv_blocks = self.allocate_kv_cache()
        if self.device.type == "cuda" and not config.enforce_eager and config.cuda_graph_max_bs != 0:
            self.graphs = CudaGraphRunner(self.model, config, self.device, self.tokens)

    # ---- KV cache ------------------------------------------------------------------------
    def allocate_kv_cache(self) -> int:
        block_bytes = 2 * len(self.attention_layers) * self.config.torch_dtype.itemsize * math.prod(self.kv_block_shape)
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None and self.device.type == "cuda":
            peak = self.measure_activation_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.gpu_memory_utilization - (total - free) - peak
            num_blocks = int(budget // block_bytes)
        elif num_blocks is None:
            needed = self.config.max_num_seqs * -(-self.config.max_model_len // self.block_size)
            num_blocks = min(needed, CPU_KV_CACHE_BYTES // block_bytes)
        if dist.is_initialized():  # tensor parallel: the ranks share one block table, so the smallest cache wins
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            num_blocks = int(t.item())
        if num_blocks < 1:
            raise ValueError("no memory for the KV cache: lower max_num_batched_tokens or raise gpu_memory_utilization")
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def bind_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, *self.kv_block_shape,
                                    dtype=self.config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def measure_activation_peak(self) -> int:
        """Run the largest prefill the scheduler can send once and return the activation memory it
        peaked at. Its K/V is written nowhere (slot -1), and every block table reads one scratch block."""
        tokens = self.config.max_num_batched_tokens
        num_seqs = max(1, min(self.config.max_num_seqs, tokens // self.config.max_model_len))
        n = tokens // num_seqs  # tokens per sequence
        self.bind_kv_cache(1)
        step = StepInput(input_ids=[0] * n * num_seqs,
                         positions=list(range(n)) * num_seqs,
                         slot_mapping=[-1] * n * num_seqs,
                         context_lens=[n] * num_seqs,
                         block_tables=[[0] * -(-n // self.block_size)] * num_seqs,
                         cu_seqlens_q=list(range(0, n * num_seqs + 1, n)),
                         sample_indices=list(range(n - 1, n * num_seqs, n)),
                         sample_lens=[n] * num_seqs,
                         temperatures=[0.0] * num_seqs,
                         seeds=[0] * num_seqs)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.forward(step)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.bind_kv_cache(0)
        torch.cuda.empty_cache()
        return peak

    # ---- one step --------------------------------------------------------------------------
    def upload(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list on the device without waiting for the GPU (pinned memory, non-blocking copy)."""
        pinned = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return pinned.to(self.device, non_blocking=True)

    def step_metadata(self, step: StepInput) -> StepMetadata:
        n = step.num_decodes
        md = StepMetadata(num_decodes=n,
                          slot_mapping=self.upload(step.slot_mapping, torch.int64),
                          context_lens=self.upload(step.context_lens, torch.int32),
                          block_tables=self.upload(step.block_tables, torch.int32))
        if n < len(step.context_lens):  # the prefill part: its chunks' offsets start at 0
            cu = [offset - n for offset in step.cu_seqlens_q[n:]]
            md.cu_seqlens_q = self.upload(cu, torch.int32)
            md.max_seqlen_q = max(b - a for a, b in zip(cu, cu[1:]))
            md.host_cu_seqlens_q, md.host_context_lens = cu, step.context_lens[n:]
        if step.lora_rank:  # each token takes its sequence's slot
            cu = step.cu_seqlens_q
            slots = [slot for slot, a, b in zip(step.lora_slots, cu, cu[1:]) for _ in range(a, b)]
            md.lora_rank, md.lora_slots = step.lora_rank, self.upload(slots, torch.int32)
        return md

    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits [rows, vocab] and sampled ids [rows] of the step's sampling rows; the ids
        also go into the token table, for the next step's placeholders. Every tensor-parallel
        rank runs this and samples the same ids."""
        for slot, adapter in step.lora_loads:
            load_adapter(self.model, slot, adapter)
        replayed = self.graphs.replay(step) if self.graphs is not None else None
        logits, sampled = replayed if replayed is not None else (self.eager_logits(step), None)
        if sampled is None or step.needs_logits:  # a graph samples without top-k/p and masks
            sampled = self.sample(step, logits)
        if step.copy_from:  # forks' copies of their parent's partial block, once it is computed
            src = self.upload(step.copy_from, torch.int64)
            self.kv_cache[:, :, self.upload(step.copy_to, torch.int64)] = self.kv_cache[:, :, src]
        return logits, sampled

    def eager_logits(self, step: StepInput) -> torch.Tensor:
        ids = self.tokens.resolve(self.upload(step.input_ids, torch.int64))
        positions = self.upload(step.positions, torch.int64)
        set_step_metadata(self.step_metadata(step))
        hidden = self.model(ids, positions)
        set_step_metadata(None)
        return self.model.compute_logits(hidden[self.upload(step.sample_indices, torch.int64)])

    def sample(self, step: StepInput, logits: torch.Tensor) -> torch.Tensor:
        top = None
        if step.top_ks is not None:
            top = (self.upload(step.top_ks, torch.int64), self.upload(step.top_ps, torch.float32))
        banned = None
        if step.banned_rows:
            banned = (self.upload(step.banned_rows, torch.int64), self.upload(step.banned_ids, torch.int64))
        sampled = sample(logits,
                         temperatures=self.upload(step.temperatures, torch.float32),
                         seeds=self.upload(step.seeds, torch.int64),
                         lengths=self.upload(step.sample_lens, torch.int64),
                         top=top, banned=banned)
        self.tokens.put(sampled)
        return sampled

    @torch.inference_mode()
    def launch(self, batch: Batch) -> InFlight:
        step = build_step(batch, self.block_size)
        logits, sampled = self.forward(step)
        logprobs = None
        if step.num_logprobs is not None:
            logprobs = top_logprobs(logits, sampled, max(step.num_logprobs))
            logprobs = tuple(t.to("cpu", non_blocking=True) for t in logprobs)
        # the sampled ids, from the GPU into pinned memory without waiting
        tokens = sampled.to("cpu", non_blocking=True)
        done = torch.cuda.current_stream().record_event() if self.device.type == "cuda" else None
        return InFlight(batch, tokens, done, step.num_logprobs, logprobs)

    @staticmethod
    def collect(launched: InFlight) -> tuple[list[int], list[dict] | None]:
        """The step's sampled ids and, when some row asked, each row's {token id: logprob}
        (its top N and the sampled token's; None for a row that did not ask)."""
        if launched.done is not None:
            launched.done.synchronize()
        ids = launched.tokens.tolist()
        if launched.logprobs is None:
            return ids, None
        chosen, top_values, top_ids = (t.tolist() for t in launched.logprobs)
        rows = []
        for row, n in enumerate(launched.num_logprobs):
            entry = dict(zip(top_ids[row][:n], top_values[row][:n])) if n >= 0 else None
            if entry is not None:
                entry[ids[row]] = chosen[row]
            rows.append(entry)
        return ids, rows

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = self.model = self.kv_cache = self.attention_layers = self.tokens = None
        torch.cuda.empty_cache()  # a no-op without CUDA
