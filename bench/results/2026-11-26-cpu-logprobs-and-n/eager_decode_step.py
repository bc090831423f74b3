import sys, time, statistics, torch
sys.path.insert(0, ".")
from ringleader.device.model import LlamaModel
from ringleader.device.model.eager_step import EagerStep
from ringleader.device.model.kv_cache import KVCache
from ringleader.device.model.step_layout import StepLayout
path = "/work/main/.venv/share/ringleader/models/SmolLM2-135M-Instruct.Q4_1.gguf"
model = LlamaModel.from_gguf(path)
PS, pages = 16, 16
kv = KVCache.for_model(model.config, pages, PS)
lay = StepLayout.allocate(1, 16, "cpu", pages, model.config.vocab_size)
lay.block_table[0] = torch.arange(pages, dtype=torch.int32)
step = EagerStep(model, kv)
lay.n_tokens[0], lay.n_segments[0], lay.n_samples[0] = 1, 1, 1
lay.seg_slot[0], lay.seg_row_start[0], lay.seg_n_rows[0] = 0, 0, 1
lay.sample_row[0], lay.sample_slot[0] = 0, 0
lay.slot_of[0] = 0
times = []
for r in range(int(sys.argv[1])):
    lay.positions[0] = 64 + r % 100
    lay.token_ids[0] = 100 + r
    t = time.perf_counter(); step.run(1, lay); times.append(time.perf_counter() - t)
print(sys.argv[2], "median ms", round(statistics.median(times[20:]) * 1e3, 2), "mean", round(statistics.mean(times[20:]) * 1e3, 2))
