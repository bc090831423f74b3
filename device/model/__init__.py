"""Llama-family model, KV cache, checkpoint loading and sampling."""

from device.model.config import ModelConfig
from device.model.kv_cache import KVCache
from device.model.llama import LlamaModel, generate_greedy
from device.model.presets import PRESETS, preset_config
from device.model.sampling import counter_uniform, sample
from device.model.step_batch import StepBatch, StepPlan

__all__ = [
    "PRESETS",
    "KVCache",
    "LlamaModel",
    "ModelConfig",
    "StepBatch",
    "StepPlan",
    "counter_uniform",
    "generate_greedy",
    "preset_config",
    "sample",
]
