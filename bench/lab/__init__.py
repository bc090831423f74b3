"""The lab: what only this repository runs (the GPU bring-up, ahead-of-time compiles, gpu_limits,
micro-benchmarks, soak and abuse, parity checks). Not shipped in the wheel; it may reach into the
engine's internals, which the shipped load test (bench/) does not need to."""
