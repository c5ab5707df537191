"""Finding a checkpoint and loading its weights into the (possibly sharded) model.

A model is named by a local HF-format directory or a hub id. Hub ids go through
huggingface_hub's normal cache (offline machines get a clear error). Weights stream out of the
.safetensors files one tensor at a time: each checkpoint name is mapped to its nanograph
parameter (q/k/v -> the fused qkv_proj, gate/up -> gate_up_proj), and the parameter's own
`weight_loader` copies in this rank's shard. `load_format="dummy"` fills random weights from
config.json alone, for benchmarks of a model shape without its download.
"""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def resolve_model_dir(model: str, weights: bool = True) -> str:
    if os.path.isdir(model):
        return model
    if os.path.exists(model) or model.count("/") != 1:
        raise ValueError(f"model {model!r}: no such local directory, and not a hub id (owner/name)")
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model"] if weights else ["*.json", "*.txt", "*.model"]
    try:
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, gated...: all end the same way for the user
        raise ValueError(f"model {model!r}: not a local directory and could not be fetched from the hub "
                         f"({type(e).__name__}: {e})") from None


def load_weights(model: nn.Module, model_dir: str) -> None:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model {model_dir!r}: no .safetensors files (use load_format='dummy' for random weights)")
    params = dict(model.named_parameters(remove_duplicate=False))
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                target, shard_id = name, None
                for part, (fused, shard) in model.packed_modules.items():
                    if f".{part}." in name:
                        target, shard_id = name.replace(f".{part}.", f".{fused}."), shard
                        break
                if target not in params:
                    continue  # e.g. rotary caches some checkpoints store
                param = params[target]
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    param.data.copy_(f.get_tensor(name))
                else:
                    loader(param, f.get_tensor(name), shard_id)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() > 1:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)
