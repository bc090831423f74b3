"""The control block's counters are declared once (ringleader.ipc.counters.COUNTERS) and every place
that names them derives from the declaration: RlControl's fields, the device's mirror (generated
into the layout header), HostRings.counters(), the server's snapshot and Prometheus families, and
docs/metrics.md's table.  A counter added to a copy of the declaration reaches each of them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.sched.build import SCHEDULER_SOURCES
from ringleader.hostctl.serving.prometheus import PREFIX, ServerCollector
from ringleader.hostctl.serving.snapshot import ServerSnapshot
from ringleader.ipc import counters, layout
from ringleader.ipc.counters import COUNTERS, EXPORTED, markdown_rows
from ringleader.ipc.histogram import HistogramSnapshot
from ringleader.ipc.rings import LIVENESS_FIELDS, RingConfig
from tests.sched_driver import Driver

ROOT = Path(__file__).resolve().parent.parent
SMALL = RingConfig(
    n_slots=2, max_ctx=64, token_budget=16, sq_size=16, cq_size=64, arena_size=256, pending_cap=8
)
# Counter writes outside the mirror, each on purpose: a CQ stall is published the moment it
# happens (the host is behind, and should see it), and the whole pool is free at init.
WRITTEN_OUTSIDE_THE_MIRROR = {"cq_stalls", "kv_pages_free"}


def exported_families(device_counters: dict[str, int]) -> dict[str, tuple[str, str, float]]:
    """The exporter's families for a snapshot holding these counters: name -> (type, help, value)."""
    empty = HistogramSnapshot((1.0,), (0, 0), 0.0, 0)
    snap = ServerSnapshot(
        model_name="m", description={}, batch_slots=1, running=0, waiting=0, in_flight=0,
        accepted=0, prompt_tokens=0, generation_tokens=0, finished={}, errors={}, rejected={},
        bad_frames=0, latencies=dict.fromkeys(
            ("ttft_s", "inter_token_s", "time_per_output_token_s", "e2e_s", "queue_s",
             "request_prompt_tokens", "request_generation_tokens"), empty),
        thread_cpu_s={}, step_histograms={}, device_counters=device_counters, kv_cache_usage=0.0,
        kv_pages=1, engine_dead=None,
    )  # fmt: skip
    families = ServerCollector(SimpleNamespace(snapshot=lambda: snap)).collect()
    return {f.name: (f.type, f.documentation, f.samples[0].value) for f in families if f.samples}


# ---------------------------------------------------------------- every derived place equals it


def test_rlcontrol_ends_with_the_declared_counters_in_order():
    fields = layout.CONTROL.fields
    after_liveness = fields[[f.name for f in fields].index("_dev_pad") + 1 :]
    assert [(f.name, f.kind) for f in after_liveness] == [(c.name, c.kind) for c in COUNTERS]


def test_the_generated_mirror_writes_every_counter_once_from_scheduler_state():
    header = layout.c_header()
    macro = header[header.index("#define RL_MIRROR_COUNTERS") :]
    written = re.findall(r"rl_host_write\(&ctl->(\w+),", macro)
    assert written == [c.name for c in COUNTERS]
    sched_fields = {f.name for f in layout.SCHED.fields}
    for c in COUNTERS:  # a sum of RlSchedState fields, nothing the host could not name
        assert re.fullmatch(r"st\.\w+( \+ st\.\w+)*", c.mirrored_from), c.name
        assert set(re.findall(r"st\.(\w+)", c.mirrored_from)) <= sched_fields, c.name


def test_the_scheduler_mirrors_through_the_generated_macro_only():
    common = (ROOT / "device" / "sched" / "sched_common.h").read_text()
    body = common[common.index("void rl_mirror_counters(") :]
    body = body[: body.index("\n}\n")]
    assert "RL_MIRROR_COUNTERS(ctl, st);" in body
    assert re.findall(r"rl_host_write\(&ctl->(\w+)", body) == ["heartbeat_ns"]
    source = "\n".join((ROOT / "device" / "sched" / name).read_text() for name in SCHEDULER_SOURCES)
    by_hand = {c.name for c in COUNTERS if re.search(rf"ctl->{c.name}\b", source)}
    assert by_hand == WRITTEN_OUTSIDE_THE_MIRROR


def test_the_cpu_scheduler_mirrors_each_counter_from_its_source():
    """Run requests (one aborted) on the real CPU build, stop it (the exit mirrors), and read
    every counter back: each equals its declared expression over the scheduler's state."""
    d = Driver(SMALL)
    handles = [d.submit(np.arange(1, 9) + 10 * k, 4) for k in range(3)]
    d.step()
    d.abort(handles[-1])
    d.run_until_idle()
    time.sleep(0.002)  # past RL_MIRROR_NS: the idle pass below mirrors too
    d.rings.request_shutdown()
    assert d.step() == layout.StepStatus.SHUTDOWN
    state = d.a["sched"][0]
    st = SimpleNamespace(**{name: int(state[name]) for name in state.dtype.names})
    mirrored = d.rings.counters()
    assert mirrored["steps"] > 0 and mirrored["aborts"] == 1
    assert {c.name: mirrored[c.name] for c in COUNTERS} == {
        c.name: eval(c.mirrored_from, {}, {"st": st}) for c in COUNTERS
    }


def test_host_counters_are_the_declared_ones_then_liveness_then_derived():
    names = list(HostMemory(SMALL).rings.counters())
    declared = [c.name for c in COUNTERS]
    assert names[: len(declared) + len(LIVENESS_FIELDS)] == [*declared, *LIVENESS_FIELDS]


def test_the_exporter_has_one_family_per_declared_series_with_its_counter():
    values = {c.name: 100 + i for i, c in enumerate(COUNTERS)}
    families = exported_families(values)
    for c, series in EXPORTED:
        assert families[PREFIX + series.name] == (series.type, series.help, values[c.name])
    unexported = {values[c.name] for c in COUNTERS if c.series is None}
    assert not {v for _, _, v in families.values()} & unexported


def test_the_metrics_page_holds_the_declarations_table_exactly():
    page = (ROOT / "docs" / "metrics.md").read_text()
    header = "| counter | series | unit | meaning |\n|---|---|---|---|\n"
    table = page[page.index(header) + len(header) :].split("\n\n")[0]
    assert table == markdown_rows(PREFIX)


# ---------------------------------------------------------------- adding one


ADDED = (
    '    Counter("prefilling", "st.n_queued", "slots", "batch slots still in prefill, now",\n'
    '            Series("num_requests_prefilling", "gauge", "Requests in a batch slot still prefilling.")),\n'
)

_WITH_A_COUNTER_ADDED = """
import importlib.util, json, subprocess, sys, tempfile
import ringleader.ipc
path = sys.argv[1]
source = open(path).read()
assert source.count("\\n)\\n# fmt: on") == 1
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("ringleader.ipc.counters", None))
sys.modules["ringleader.ipc.counters"] = ringleader.ipc.counters = module
exec(compile(source.replace("\\n)\\n# fmt: on", "\\n" + sys.argv[2] + ")\\n# fmt: on"), path, "exec"), module.__dict__)

from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.sched.build import scheduler_source
from ringleader.ipc import layout
from tests.test_counters import PREFIX, SMALL, exported_families

with tempfile.NamedTemporaryFile("w", suffix=".cpp") as f:
    f.write(scheduler_source("cpu_entry.cpp"))
    f.flush()
    compiled = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f.name], capture_output=True, text=True)
print(json.dumps({
    "control": list(layout.CONTROL.numpy_dtype().names),
    "header": layout.c_header(),
    "compiles": compiled.returncode == 0,
    "host": list(HostMemory(SMALL).rings.counters()),
    "families": exported_families({c.name: 7 for c in module.COUNTERS}),
    "docs": module.markdown_rows(PREFIX),
}))
"""


def test_a_counter_added_to_a_copy_of_the_declaration_reaches_every_place():
    """The one line above, added to ipc/counters.py (in a fresh interpreter, the file untouched):
    RlControl grows the field, the mirror writes it, and it compiles; the host reads it, the
    exporter has its family and the page's table its row."""
    pytest.importorskip("prometheus_client")
    out = subprocess.run(
        [sys.executable, "-c", _WITH_A_COUNTER_ADDED, counters.__file__, ADDED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["control"][-1] == "prefilling"
    assert "rl_host_write(&ctl->prefilling, (decltype(ctl->prefilling))(st.n_queued));" in got["header"]
    assert got["compiles"]
    assert "prefilling" in got["host"]
    assert got["families"][PREFIX + "num_requests_prefilling"] == [
        "gauge",
        "Requests in a batch slot still prefilling.",
        7,
    ]
    assert got["docs"].endswith(
        "| `prefilling` | `ringleader:num_requests_prefilling` (gauge) | slots | batch slots still in prefill, now |"
    )
