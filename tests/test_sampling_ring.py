"""The sampling settings' way through the rings (the real CPU build of the scheduler): RlSampling is
the declaration's ring fields; what the host writes into the SQ entry is what the slot holds after
admission and what every sample entry of that slot carries, field for field, so the scheduler,
which copies the struct whole, can never drop or mix up a field."""

import dataclasses

import numpy as np

from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from ringleader.ipc.sampling_params import FIELDS, RING_FIELDS, SamplingParams
from tests.sched_driver import Driver


def test_rlsampling_is_the_declarations_ring_fields_in_order():
    assert [(f.name, f.kind) for f in layout.SAMPLING.fields] == list(RING_FIELDS)
    assert [name for name, _ in RING_FIELDS] == [spec.name for spec in FIELDS if spec.ring]
    sq = dict(layout.SQ_ENTRY.numpy_dtype().fields)
    slot = dict(layout.SLOT.numpy_dtype().fields)
    assert sq["sampling"][0] == slot["sampling"][0] == layout.SAMPLING.numpy_dtype()
    for name, _ in RING_FIELDS:  # no sampler field lives outside the struct
        assert name not in sq and name not in slot
    header = layout.c_header()
    assert "RlSampling sampling;" in header and "RlSampling* sample_params;" in header


SETTINGS = [
    SamplingParams(temperature=0.7, top_p=0.9, top_k=33, min_p=0.1, seed=2**64 - 3, logprobs=20),
    SamplingParams(temperature=1.3, presence_penalty=-1.5, frequency_penalty=2.0, seed=7, logprobs=0),
    SamplingParams(repetition_penalty=1.25, top_k=-1, seed=11),
]


def test_each_field_reaches_the_slot_and_the_sample_entries_unchanged():
    cfg = RingConfig(
        n_slots=4,
        max_ctx=64,
        token_budget=16,
        sq_size=16,
        cq_size=256,
        arena_size=1024,
        pending_cap=16,
        vocab_size=64,
    )
    d = Driver(cfg)
    handles = {}
    for params in SETTINGS:
        skip = ("max_tokens", "stop_token_ids", "ignore_eos", "n")
        fields = {k: v for k, v in dataclasses.asdict(params).items() if k not in skip}
        handles[d.submit([1, 2, 3, 4, 5], 6, **fields)] = params
    sq = d.a["sq"]
    for pos, params in enumerate(SETTINGS):
        entry = sq[pos]["sampling"]
        for name, _ in RING_FIELDS:
            assert entry[name] == np.asarray(params.ring_values()[name], entry[name].dtype), name
        flags = int(sq[pos]["flags"])
        assert bool(flags & layout.SqFlag.PENALIZED) == params.penalized
        assert bool(flags & layout.SqFlag.LOGPROBS) == (params.logprobs is not None)
    seen = set()
    for _ in range(20):
        d.step()
        slots = d.a["slots"]
        n = int(d.a["step"][0]["n_samples"])
        for q in range(n):
            s = int(d.a["sample_slot"][q])
            params = handles[int(slots[s]["handle"])]
            entry = d.a["sample_params"][q]
            assert entry.tobytes() == slots[s]["sampling"].tobytes()
            for name, _ in RING_FIELDS:
                assert entry[name] == np.asarray(params.ring_values()[name], entry[name].dtype), name
            seen.add(int(slots[s]["handle"]))
    assert seen == set(handles)
