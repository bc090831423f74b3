"""Llama-family model, KV cache, checkpoint loading and sampling."""
from device.model.config import ModelConfig
from device.model.kv_cache import KVCache
from device.model.llama import LlamaModel, generate_greedy
from device.model.presets import PRESETS, preset_config
from device.model.sampling import counter_uniform, sample
from device.model.step_batch import StepBatch, StepPlan

__all__ = [
    "ModelConfig",
    "KVCache",
    "LlamaModel",
    "generate_greedy",
    "PRESETS",
    "preset_config",
    "sample",
    "counter_uniform",
    "StepBatch",
    "StepPlan",
]
