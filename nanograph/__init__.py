"""nanograph: a small, readable LLM inference engine built around captured CUDA graphs for decode.
"""
from nanograph.llm import LLM
from nanograph.lora import LoRARequest
from nanograph.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]
