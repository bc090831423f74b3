"""The Llama-family model: its shape (config), presets, the decoder and its pointwise ops; what
`--model` may name.  The weights, the step, sampling and the null model have folders of their own
beside this one (device/weights, device/step, device/sampling, device/null)."""

from ringleader.device.model.config import ModelConfig
from ringleader.device.model.llama import LlamaModel, generate_greedy
from ringleader.device.model.presets import PRESETS, preset_config

__all__ = ["PRESETS", "LlamaModel", "ModelConfig", "generate_greedy", "preset_config"]
