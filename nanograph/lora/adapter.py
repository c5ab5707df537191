"""LoRA adapters: the request that names one, and reading it from a PEFT directory.

A LoRA adapter adds a low-rank update to some of the model's linear layers: for a layer with
weight W, `y = x W^T + scaling * (x A^T) B^T`, with A [r, in], B [out, r], r small (8-64) and
`scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). `peft`'s `save_pretrained`
writes it as `adapter_config.json` + `adapter_model.safetensors`, one lora_A / lora_B pair per
targeted module (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, ...).

An adapter is checked when its first request comes in, from the config and the tensor headers
(no tensor is read): every tensor must target a layer and module the model has, with the shape
that module and the adapter's rank imply, so a bad adapter is a clear error before any work,
never a crash mid-generation. Its weights are read from disk when the engine loads it into one
of its GPU slots (lora/layer.py), which may happen again after it was evicted.
"""
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open

# PEFT's names of a decoder layer's linear modules
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# groups: the module's path in the model, its layer, its name, A or B
TENSOR_NAME = re.compile(
    r"base_model\.model\.(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")
UNSUPPORTED = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
               "layers_to_transform", "lora_bias")


@dataclass(frozen=True)
class LoRARequest:
    name: str
    path: str


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    rank: int
    scaling: float

    @property
    def cache_salt(self) -> int:
        """Where its sequences' prefix-cache hash chains start: its K/V differ from the base
        model's and other adapters' for the same tokens."""
        return xxhash.xxh64_intdigest(repr(self.request).encode())


def module_shapes(hf):
    """(out, in) features of each target module in the full (unsharded) model."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    q = hf.num_attention_heads * head_dim
    kv = hf.num_key_value_heads * head_dim
    hidden, inter = hf.hidden_size, hf.intermediate_size
    return {"q_proj": (q, hidden),
            "k_proj": (kv, hidden),
            "v_proj": (kv, hidden),
            "o_proj": (hidden, q),
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def read_adapter(request: LoRARequest, hf, max_rank, where="") -> Adapter:
    """Check a PEFT adapter directory against the model (config and tensor shapes); ValueError if
    anything is wrong, naming the adapter (after `where`, e.g. the request)."""
    def fail(why: str):
        raise ValueError(f"{where}LoRA adapter {request.name!r} ({request.path}): {why}")
    folder = Path(request.path)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        if not (folder / file).is_file():
            fail(f"{file} not found")
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except ValueError as e:  # (bad JSON, bad UTF-8)
        fail(f"adapter_config.json is not valid JSON: {e}")
    if not isinstance(cfg, dict):
        fail("adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("bias", "none") != "none":
        fail("only plain LoRA without bias is supported "
             f"(peft_type {cfg.get('peft_type')}, bias {cfg.get('bias')})")
    if any(cfg.get(key) for key in UNSUPPORTED):
        fail(f"{', '.join(k for k in UNSUPPORTED if cfg.get(k))} not supported")
    if not isinstance(cfg.get("r"), int) or not isinstance(cfg.get("lora_alpha"), (int, float)):
        fail(f"adapter_config.json needs an integer r and a lora_alpha, got r={cfg.get('r')!r}")
    rank = cfg["r"]
    if not 1 <= rank <= max_rank:
        fail(f"rank {rank} is above max_lora_rank={max_rank}")
    shapes, pairs = module_shapes(hf), set()
    try:
        tensors = safe_open(str(folder / "adapter_model.safetensors"), framework="pt")
    except SafetensorError as e:
        fail(f"adapter_model.safetensors is damaged: {e}")
    with tensors as f:
        for name in f.keys():
            match = TENSOR_NAME.fullmatch(name)
            if not match or match[3] not in TARGETS or int(match[2]) >= hf.num_hidden_layers:
                fail(f"tensor {name} targets a module the model does not have")
            out, inp = shapes[match[3]]
            want = (rank, inp) if match[4] == "A" else (out, rank)
            if tuple(f.get_slice(name).get_shape()) != want:
                fail(f"tensor {name} has shape {tuple(f.get_slice(name).get_shape())}, "
                     f"expected {want} (rank {rank})")
            pairs.add((match[1], match[4]))  # (module, A or B)
    if not pairs or len({p for p, _ in pairs}) * 2 != len(pairs):
        fail("every targeted module needs both lora_A and lora_B, and at least one module")
    return Adapter(request, rank,
                   cfg["lora_alpha"] / (math.sqrt(rank) if cfg.get("use_rslora") else rank))


def adapter_weights(adapter: Adapter):
    """(module path, e.g. model.layers.3.self_attn.q_proj, A [r, in], scaling * B [out, r]) for each
    targeted module."""
    weights = Path(adapter.request.path, "adapter_model.safetensors")
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():
            match = TENSOR_NAME.fullmatch(name)
            if match[4] == "A":
                b = f.get_tensor(name.replace("lora_A", "lora_B"))
                yield match[1], f.get_tensor(name), adapter.scaling * b.to(torch.float32)
