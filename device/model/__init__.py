"""Llama-family model, paged KV cache, checkpoint loading and sampling."""

from ringleader.device.model.config import ModelConfig
from ringleader.device.model.eager_step import EagerStep
from ringleader.device.model.kv_cache import KVCache
from ringleader.device.model.llama import LlamaModel, generate_greedy
from ringleader.device.model.presets import PRESETS, preset_config
from ringleader.device.model.sampling import SamplingTensors, counter_uniform, sample
from ringleader.device.model.step_batch import StepBatch, StepPlan
from ringleader.device.model.step_layout import StepLayout

__all__ = [
    "PRESETS",
    "EagerStep",
    "KVCache",
    "LlamaModel",
    "ModelConfig",
    "SamplingTensors",
    "StepBatch",
    "StepLayout",
    "StepPlan",
    "counter_uniform",
    "generate_greedy",
    "preset_config",
    "sample",
]
