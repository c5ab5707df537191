"""Engine knobs, validated once, before any weight is loaded.

The defaults follow vLLM / nano-vllm, and so do the names (vLLM's `block_size` is accepted for
`kvcache_block_size`). Everything derived from them (device, dtype, the HF model config, the
effective max_model_len) is computed here too, so the rest of the engine reads plain, checked
values. A bad knob is a ValueError that names it.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from nanograph.sampling_params import is_int, is_number
from nanograph.utils.loader import resolve_model_dir

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # by torch's names ("half" too)
# the integer knobs and their least value
COUNTS = {"max_model_len": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1,
          "max_num_mixed_tokens": 1, "kvcache_block_size": 16, "tensor_parallel_size": 1,
          "max_loras": 1, "max_lora_rank": 1, "seed": 0,
          "num_kvcache_blocks": 1, "cuda_graph_max_bs": 0}
OPTIONAL_COUNTS = ("num_kvcache_blocks", "cuda_graph_max_bs")  # (None: sized from memory)


@dataclass
class Config:
    model: str
    device: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"                  # "auto" (safetensors) or "dummy" (random weights)
    max_model_len: int = 4096
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384        # a step's prefill tokens when nothing decodes
    max_num_mixed_tokens: int = 2048           # ... when something does (scheduler.py)
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None      # None: as many as memory allows
    kv_cache_dtype: str = "auto"               # "auto": the model's dtype; "fp8": e4m3 K/V
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    cuda_graph_max_bs: int | None = None       # None: min(max_num_seqs, 512); 0: no graphs
    cuda_graph_sizes: list[int] | None = None  # explicit bucket ladder (default: see cuda_graph.py)
    attention_backend: str = "auto"            # auto (resolved here) | flash_attn | triton | torch
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    seed: int = 0
    overlap_scheduling: bool | None = None     # None: on with CUDA (see llm.py)
    enable_lora: bool = False
    max_loras: int = 4                         # adapters resident at once (GPU slots)
    max_lora_rank: int = 64
    speculative_config: dict | None = None     # {"method": "ngram", ...}: spec/ checks it
    block_size: int | None = None              # vLLM's name for kvcache_block_size
    # and, derived in __post_init__:
    # model_dir (str), hf_config (the HF PretrainedConfig), torch_dtype, kv_cache_torch_dtype

    def __post_init__(self):
        if self.block_size is not None:
            self.kvcache_block_size = self.block_size
        for name, least in COUNTS.items():
            value = getattr(self, name)
            if value is None and name in OPTIONAL_COUNTS:
                continue
            if not is_int(value) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        cuda = self.device.startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}, but CUDA is not available here")
        for name, allowed in (("load_format", ("auto", "dummy")),
                              ("kv_cache_dtype", ("auto", "fp8")),
                              ("attention_backend", ("auto", "flash_attn", "triton", "torch"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        bs = self.kvcache_block_size
        if bs > 256 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two in [16, 256], got {bs}")
        if not is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graph_sizes is not None and min(self.cuda_graph_sizes, default=0) < 1:
            raise ValueError("cuda_graph_sizes must be a non-empty list of sizes >= 1, "
                             f"got {self.cuda_graph_sizes}")
        # off CUDA, Triton runs only in its interpreter (the tests')
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        needs_cuda = ("flash_attn",) if interpreted else ("flash_attn", "triton")
        if not cuda and self.attention_backend in needs_cuda:
            raise ValueError(f"attention_backend={self.attention_backend!r} needs CUDA, and "
                             f"device={self.device!r}: use 'torch' (or 'auto')")
        if self.attention_backend == "flash_attn":  # (what it can read: its own checks)
            from nanograph.kernels.backends import check_flash_attn
            check_flash_attn(self)
        # triton measured at least as fast as flash_attn (layers/attention.py)
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if cuda else "torch"
        self.max_num_mixed_tokens = min(self.max_num_mixed_tokens, self.max_num_batched_tokens)
        if self.overlap_scheduling is None:
            self.overlap_scheduling = cuda
        self.model_dir = resolve_model_dir(self.model, weights=self.load_format != "dummy")
        if not Path(self.model_dir, "config.json").exists():
            raise ValueError(f"model {self.model!r}: no config.json in {self.model_dir}")
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.torch_dtype = self._resolve_dtype()
        self.kv_cache_torch_dtype = (torch.float8_e4m3fn if self.kv_cache_dtype == "fp8"
                                     else self.torch_dtype)

    def _resolve_dtype(self):
        """auto: the checkpoint's half type (else bf16) on CUDA, float32 on the CPU."""
        if self.dtype == "auto":
            dtype = self.hf_config.dtype  # (the checkpoint's, if it says)
            half = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
            return half if self.device.startswith("cuda") else torch.float32
        dtype = getattr(torch, str(self.dtype).removeprefix("torch."), None)
        if dtype not in DTYPES:
            raise ValueError("dtype must be 'auto' or one of float32, float16, bfloat16, "
                             f"got {self.dtype!r}")
        return dtype
