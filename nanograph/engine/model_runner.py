"""ModelRunner: owns the model and the KV cache on one device, and runs one step at a time.

A step goes: the scheduler's sequences -> `StepInput` (plain lists: the tokens to compute, their
positions and cache slots, each sequence's context length and block table) -> tensors on the
device -> forward (eager, or a CUDA-graph replay for decode) -> logits of each sequence's last
token -> sampled token ids. `StepInput` is deliberately plain data: with tensor parallelism it
is exactly what rank 0 sends the other ranks each step (see engine/tp.py).

KV cache: one tensor [2, layers, blocks, block_size, kv_heads, head_dim], each layer's
Attention holding views into it. Its size comes from memory: on CUDA, what is left of
`gpu_memory_utilization` after the weights and the activation peak of the largest prefill
(measured by a warm-up run); on the CPU a modest 1 GiB at most.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanograph.config import Config
from nanograph.engine.cuda_graph import CudaGraphRunner
from nanograph.engine.sequence import Sequence
from nanograph.layers.attention import resolve_backend
from nanograph.layers.sampler import SamplingBatch, sample
from nanograph.models.decoder import DecoderForCausalLM
from nanograph.sampling_params import SamplingParams
from nanograph.utils.context import AttentionMetadata, set_attention_metadata
from nanograph.utils.loader import init_dummy_weights, load_weights

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class StepInput:
    is_prefill: bool
    input_ids: list[int]        # the tokens computed this step, all sequences concatenated
    positions: list[int]
    slot_mapping: list[int]     # cache slot of each of those tokens
    context_lens: list[int]     # per sequence: keys to attend (cached + computed before + new)
    block_tables: list[list[int]]
    cu_seqlens_q: list[int]     # per sequence offsets into input_ids (len = sequences + 1)


def build_step(seqs: list[Sequence], is_prefill: bool, block_size: int) -> StepInput:
    if not is_prefill:  # the hot path: one token per sequence, its last, at position len - 1
        pos = [len(seq) - 1 for seq in seqs]
        return StepInput(False, [seq.token_ids[-1] for seq in seqs], pos,
                         [seq.block_table[p // block_size] * block_size + p % block_size for seq, p in zip(seqs, pos)],
                         [p + 1 for p in pos], [seq.block_table for seq in seqs], list(range(len(seqs) + 1)))
    step = StepInput(True, [], [], [], [], [], [0])
    for seq in seqs:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        step.input_ids += seq.token_ids[start:end]
        step.positions += range(start, end)
        step.slot_mapping += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        step.context_lens.append(end)
        step.block_tables.append(seq.block_table)
        step.cu_seqlens_q.append(len(step.input_ids))
    return step


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        self.config = config
        hf = config.hf_config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and config.tensor_parallel_size > 1:
            self.device = torch.device("cuda", rank)  # one GPU per tensor-parallel rank
        if (dist.get_world_size() if dist.is_initialized() else 1) != config.tensor_parallel_size:
            raise RuntimeError("the layers shard over torch.distributed's default group, whose size must be "
                               f"tensor_parallel_size={config.tensor_parallel_size} (close the other LLM first)")
        self.block_size = config.kvcache_block_size
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)  # build the weights in their final dtype directly
        with torch.device(self.device):
            self.model = DecoderForCausalLM(hf)
        torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model_dir)
        self.backend = resolve_backend(config.attention_backend, self.device, self.block_size)
        self.attention_layers = [layer.self_attn.attn for layer in self.model.model.layers]
        for attn in self.attention_layers:
            attn.backend = self.backend
        first = self.model.model.layers[0].self_attn
        # one cache block of one layer: [block_size, kv_heads on this rank, head_dim]
        self.kv_block_shape = (self.block_size, first.num_kv_heads, first.head_dim)
        self.num_kv_blocks = self.allocate_kv_cache()
        self.graphs = CudaGraphRunner(self) if self.device.type == "cuda" else None

    # ---- KV cache ------------------------------------------------------------------------
    def allocate_kv_cache(self) -> int:
        block_bytes = 2 * len(self.attention_layers) * self.config.torch_dtype.itemsize
        for dim in self.kv_block_shape:
            block_bytes *= dim
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
            raise ValueError("no memory left for the KV cache: lower max_num_batched_tokens or raise "
                             "gpu_memory_utilization")
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def bind_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, *self.kv_block_shape,
                                    dtype=self.config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def measure_activation_peak(self) -> int:
        """Run the largest prefill the scheduler can send once, on a scratch cache just big
        enough for it, and return the activation memory it peaked at."""
        tokens = self.config.max_num_batched_tokens
        num_seqs = max(1, min(self.config.max_num_seqs, tokens // self.config.max_model_len))
        blocks_per_seq = -(-tokens // num_seqs // self.block_size) + 1
        self.bind_kv_cache(num_seqs * blocks_per_seq)
        seqs = [Sequence(s, [0] * (tokens // num_seqs), SamplingParams(), self.block_size, "cpu")
                for s in range(num_seqs)]
        for s, seq in enumerate(seqs):
            seq.block_table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
            seq.num_scheduled_tokens = len(seq)
        step = build_step(seqs, True, self.block_size)
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
    def attention_metadata(self, step: StepInput) -> AttentionMetadata:
        def tensor(data, dtype=torch.int32):
            return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
        width = max(map(len, step.block_tables))
        tables = [t + [-1] * (width - len(t)) for t in step.block_tables]
        md = AttentionMetadata(step.is_prefill, tensor(step.slot_mapping, torch.int64), tensor(step.context_lens),
                               tensor(tables))
        if step.is_prefill:
            md.cu_seqlens_q, md.host_cu_seqlens_q = tensor(step.cu_seqlens_q), step.cu_seqlens_q
            md.max_seqlen_q = max(b - a for a, b in zip(step.cu_seqlens_q, step.cu_seqlens_q[1:]))
            md.host_context_lens = step.context_lens
        return md

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Logits [sequences, vocab] of each sequence's last computed token."""
        if not step.is_prefill and self.graphs is not None and self.graphs.can_run(len(step.input_ids)):
            return self.graphs.replay(step)
        if not step.is_prefill and self.graphs is not None:
            self.graphs.stats.eager_decode_steps += 1
        ids = torch.tensor(step.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        positions = torch.tensor(step.positions, dtype=torch.int64).to(self.device, non_blocking=True)
        set_attention_metadata(self.attention_metadata(step))
        hidden = self.model(ids, positions)
        set_attention_metadata(None)
        if step.is_prefill:
            last = torch.tensor(step.cu_seqlens_q[1:], dtype=torch.int64).to(self.device, non_blocking=True) - 1
            hidden = hidden[last]
        return self.model.compute_logits(hidden)

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [seq.params for seq in seqs]
        vocab = self.config.hf_config.vocab_size
        temps = torch.tensor([p.temperature for p in params], device=self.device)
        top_ks = top_ps = None
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=self.device)
            top_ps = torch.tensor([p.top_p for p in params], device=self.device)
        return SamplingBatch(temps, all(p.temperature == 0 for p in params), top_ks, top_ps,
                             [seq.generator for seq in seqs])

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = self.model = self.kv_cache = self.attention_layers = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        logits = self.forward(build_step(seqs, is_prefill, self.block_size))
        return sample(logits, self.sampling_batch(seqs)).tolist()
