"""The shape's random weights as HF builds them, and saved as a checkpoint other engines load.

nanograph and HF transformers can build a shape from its config.json alone; the peers
(peers.py) cannot, so the weights are written once per shape as a real checkpoint: HF's random
init (seed 0) in the run's dtype, as safetensors with its config.json, plus a tokenizer.
"""
import os

import torch

from benchmarks.harness import Setup, report_leftover_memory


def load_hf_model(setup: Setup, attn_implementation: str):
    """The shape as an HF transformers model on the run's device: random (seed 0) for a dummy
    shape, else the checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = getattr(torch, setup.dtype)
    if setup.load_format == "dummy":
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(setup.model_dir)
        # random init right where it runs (an 8B init on the CPU is slow)
        with torch.device(setup.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=dtype,
                                                     attn_implementation=attn_implementation)
    return model.to(setup.device).eval()


def write_checkpoint(setup: Setup) -> str:
    """The shape's random weights as a checkpoint the peers load: HF's random init (seed 0) in the
    run's dtype, saved as safetensors with its config.json (whose `dtype` nano-vllm builds the model
    in), and a word-level tokenizer (nano-vllm reads EOS from a tokenizer; the prompts are token
    ids, so nothing else uses it)."""
    path = os.path.join(setup.tmp, f"{setup.name}-checkpoint")
    print(f"  [peers] writing the random-weight checkpoint to {path} ...", flush=True)
    model = load_hf_model(setup, "sdpa")
    model.save_pretrained(path)
    config = model.config
    del model
    report_leftover_memory("the checkpoint's model")
    write_tokenizer(path, config)
    return path


def write_tokenizer(path: str, config) -> None:
    """A word-level tokenizer for the vocabulary of `config` (an HF config), saved in `path`: token
    i is the word "t<i>", so every token decodes to text of its own, and the config's EOS and BOS
    (the first of a list) are its special tokens, matched as whole words only (else "t1" would
    also match the start of "t17": the text of ids is the same ids)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {}
    for name, ids in (("eos_token", config.eos_token_id), ("bos_token", config.bos_token_id)):
        if ids is not None:
            word = f"t{ids[0] if isinstance(ids, list) else ids}"
            special[name] = AddedToken(word, single_word=True, special=True)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(path)
