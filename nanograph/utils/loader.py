"""Finding a checkpoint and loading its weights into the model.

A model is named by a local HF-format directory or a hub id. Hub ids go through
huggingface_hub's normal cache (offline machines get a clear error). Weights stream out of the
.safetensors files one tensor at a time (the files `model.safetensors.index.json` names, if
there is one, as HF writes sharded checkpoints): each checkpoint name is mapped to its nanograph
parameter (q/k/v -> the fused qkv_proj, gate/up -> gate_up_proj), and the fused parameter's
`weight_loader` copies each part into its rows (layers/linear.py). `load_format="dummy"` fills
random weights from config.json alone, for benchmarks of a model shape without its download.

The load is strict, because a damaged checkpoint otherwise still "works": a parameter left
unfilled keeps whatever memory it got, and the model answers with plausible-looking garbage.
So every tensor the model needs must be in the files (each of q, k and v for a fused one), every
tensor in the files must have a place (only rotary caches and the second copy of a tied LM head
are known to be unused), shapes must match, and an unreadable file or absent shard is named.
Tensor parallelism loads the whole model on every rank too, then cuts it (engine/tp.py).
"""
import glob
import json
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


def resolve_model_dir(model: str, weights=True):
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.txt", "*.model"] + (["*.safetensors"] if weights else [])
    try:
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, gated...: all end the same way for the user
        raise ValueError(
            f"model {model!r}: not a local directory and could not be fetched from the hub "
            f"({type(e).__name__}: {e})") from None


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    with open(index) as f:
        files = sorted({os.path.join(model_dir, name)
                        for name in json.load(f)["weight_map"].values()})
    for file in files:
        if not os.path.exists(file):
            raise ValueError(f"model {model_dir!r}: shard {os.path.basename(file)!r}, "
                             f"named in {index}, is missing")
    return files


def expected_tensors(model: nn.Module):
    """Checkpoint name -> (the parameter it fills, part, the shape the model expects of it).
    A fused parameter expects one tensor per part; a tied LM head is listed once, as the
    embedding."""
    expected = {}
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        parts = {name.replace(f".{fused}.", f".{checkpoint_name}."):
                 (param, part, (module.part_sizes[part], *param.shape[1:]))
                 for checkpoint_name, (fused, part) in model.packed_modules.items()
                 if f".{fused}." in name}
        expected.update(parts or {name: (param, None, tuple(param.shape))})
    return expected


def read_tensors(file: str):
    """(name, tensor) pairs of one .safetensors file, one at a time; an unreadable file is named."""
    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"cannot read {file!r} (truncated or not a safetensors file?): {e}") from None


def load_weights(model: nn.Module, model_dir: str):
    files = weight_files(model_dir)
    if not files:
        raise ValueError(f"model {model_dir!r}: no .safetensors files "
                         "(use load_format='dummy' for random weights)")
    expected = expected_tensors(model)
    # names that share a tensor with another parameter (a tied LM head)
    aliases = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
               - {n for n, _ in model.named_parameters()})
    seen = set()
    for file in files:
        for name, tensor in read_tensors(file):
            seen.add(name)
            if name not in expected:
                continue  # named below, unless known to be unused
            param, part, want = expected[name]
            if tuple(tensor.shape) != want:
                raise ValueError(f"{name} in {file!r} has shape {tuple(tensor.shape)}; "
                                 f"the model expects {want}")
            if part is None:  # a whole parameter
                param.data.copy_(tensor)
            else:
                param.weight_loader(param, tensor, part)
    # known to be unused: rotary caches, the tied head's second name
    unplaced = {n for n in seen - set(expected) - aliases if ".rotary_emb." not in n}
    for what, names in (("checkpoint tensor(s) the model has no place for", unplaced),
                        ("tensor(s) the model needs, missing from the checkpoint",
                         set(expected) - seen)):
        if names:  # the first few by name, and how many
            first = sorted(names)[:5] + ["..."] * (len(names) > 5)
            raise ValueError(f"model {model_dir!r}: {len(names)} {what}: {', '.join(first)}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int):
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() > 1:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)
