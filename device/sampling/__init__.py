"""Sampling: the counter-based RNG, penalties and temperature, in torch and in Triton."""
