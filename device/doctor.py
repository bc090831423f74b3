"""`ringleader doctor`: what this machine has, and whether a CUDA run would work here.

Each check adds facts to the report and, when a CUDA run would fail, a problem naming why.
Nothing here starts a persistent kernel; with a GPU it loads the scheduler module once, which is
the step most likely to fail on a new driver.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys

from ringleader.ipc.install_hint import install_hint


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict:
    """Python and the installed versions of what a CUDA run needs (imports none of them)."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in (
        "torch",
        "numpy",
        "pyzmq",
        "msgpack",
        "cuda-bindings",
        "cuda-toolkit",
        "nvidia-cuda-nvrtc",
        "triton",
    ):
        out[dist] = _version(dist)
    return out


class Doctor:
    def __init__(self, arch: str | None = None):
        self.arch = arch
        self.report: dict = {
            "versions": package_versions(),
            "environment": {},
            "cpu": None,
            "gpu": None,
            "kernel": None,
            "problems": [],
            "notes": [],
        }

    def problem(self, text: str) -> None:
        self.report["problems"].append(text)

    def note(self, text: str) -> None:
        self.report["notes"].append(text)

    def run(self) -> dict:
        self._environment()
        torch = self._torch()
        self._cpu(torch)
        gpu = self._gpu(torch) if torch is not None else False
        self._bindings()
        build = self._compile(gpu)
        if build is not None and self.report["versions"].get("driver_cuda"):
            from ringleader.device.sched.build import ptx_loadable

            driver = tuple(int(x) for x in self.report["versions"]["driver_cuda"].split("."))
            ok, why = ptx_loadable(build.nvrtc_version, driver)
            self.note(("PTX fallback possible: " if ok else "no PTX fallback: ") + why)
        if gpu and build is not None:
            self._load_module(build)
        self.report["cuda_ready"] = not self.report["problems"]
        return self.report

    def _environment(self) -> None:
        from ringleader.device.backends.cuda_preflight import environment_hazards

        names = (
            "CUDA_LAUNCH_BLOCKING",
            "CUDA_MODULE_LOADING",
            "CUDA_VISIBLE_DEVICES",
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
            "PYTORCH_NO_CUDA_MEMORY_CACHING",
        )
        self.report["environment"] = {n: os.environ.get(n) for n in names if n in os.environ}
        for hazard in environment_hazards():
            self.problem(hazard)

    def _torch(self):
        try:
            return importlib.import_module("torch")
        except Exception as exc:
            self.problem(f"torch does not import: {exc!r}")
            return None

    def _cpu(self, torch) -> None:
        """The CPU the cpu backend runs on: its extensions, the cores it may use, and the kernels
        they select (torch's dispatch level)."""
        from ringleader.device.backends.cpu_features import cpu_features

        cpu = cpu_features()
        self.report["cpu"] = {"summary": cpu.summary(), **cpu.as_description()}
        if torch is not None:
            self.report["cpu"]["aten"] = torch.backends.cpu.get_cpu_capability()

    def _gpu(self, torch) -> bool:
        self.report["versions"]["torch_cuda"] = torch.version.cuda
        if not torch.cuda.is_available():
            self.problem(
                f"no CUDA GPU is visible to torch {torch.__version__} (built for CUDA "
                f"{torch.version.cuda}); the cpu backend still runs (--device cpu)"
            )
            return False
        major, minor = torch.cuda.get_device_capability()
        free, total = torch.cuda.mem_get_info()
        self.report["gpu"] = {
            "name": torch.cuda.get_device_name(),
            "capability": f"{major}.{minor}",
            "arch": f"sm_{major}{minor}",
            "memory_gib": round(total / 2**30, 2),
            "free_gib": round(free / 2**30, 2),
            "multiprocessors": torch.cuda.get_device_properties(0).multi_processor_count,
            "allocator_backend": torch.cuda.get_allocator_backend(),
        }
        if major < 9:
            self.note(
                f"compute capability {major}.{minor}: the CUDA backend is written and "
                "tuned for Hopper (9.0); conditional graph nodes need 9.0-class drivers"
            )
        if torch.cuda.get_allocator_backend() != "native":
            self.problem(
                f"torch's allocator backend is {torch.cuda.get_allocator_backend()!r}; "
                "the device scheduler needs 'native'"
            )
        try:
            importlib.import_module("triton")
        except Exception as exc:
            self.problem(f"triton does not import ({exc!r}); the CUDA step's attention needs it")
        return True

    def _bindings(self) -> None:
        version = self.report["versions"].get("cuda-bindings")
        if version is None:
            self.problem(f"cuda-bindings is not installed: {install_hint('cuda')}")
            return
        if not version.startswith("13."):
            self.problem(
                f"cuda-bindings {version}: the CUDA backend uses the 13.x API (cuda-bindings>=13,<14)"
            )
        try:
            from ringleader.device.backends import cuda_driver as drv

            drv.check(drv.cu.cuInit(0), "cuInit")
            self.report["versions"]["driver_cuda"] = "%d.%d" % drv.driver_version()
        except Exception as exc:
            self.report["versions"]["driver_cuda"] = None
            self.note(f"no CUDA driver usable here ({exc})")

    def _compile(self, gpu: bool):
        from ringleader.device.sched.build import compile_kernel, nvrtc_library

        arch = self.arch or (self.report["gpu"]["arch"] if gpu else "sm_90")
        try:
            build = compile_kernel(arch)
        except Exception as exc:
            self.problem(f"NVRTC could not build the scheduler for {arch}: {exc}")
            return None
        self.report["kernel"] = {
            "arch": arch,
            "cubin_bytes": len(build.cubin),
            "ptx_isa": build.ptx_isa,
            "nvrtc": "%d.%d" % build.nvrtc_version,
            "nvrtc_library": nvrtc_library(),
            "functions": {n: vars(r) for n, r in build.resources.items()},
        }
        for name, r in build.resources.items():
            if r.spill_bytes:
                self.note(f"{name} spills {r.spill_bytes} bytes to local memory")
        return build

    def _load_module(self, build) -> None:
        from ringleader.device.backends import cuda_driver as drv
        from ringleader.device.sched.build import KERNELS

        try:
            module, how = drv.load_module(build)
            for name in KERNELS:
                drv.get_function(module, name)
            self.report["kernel"]["loaded_from"] = how
        except Exception as exc:
            self.problem(f"the driver does not load the scheduler module: {exc}")


def format_report(report: dict) -> str:
    lines = ["versions:"]
    lines += [f"  {k}: {v}" for k, v in report["versions"].items()]
    cpu = report.get("cpu")
    if cpu:
        lines.append(f"cpu: {cpu['summary']}" + (f", torch kernels {cpu['aten']}" if cpu.get("aten") else ""))
    gpu = report.get("gpu")
    lines.append("gpu: " + (", ".join(f"{k} {v}" for k, v in gpu.items()) if gpu else "none"))
    if report["environment"]:
        lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in report["environment"].items()))
    k = report.get("kernel")
    if k:
        lines.append(
            f"scheduler kernel for {k['arch']} (NVRTC {k['nvrtc']} from {k.get('nvrtc_library')}, "
            f"PTX ISA {k['ptx_isa']}, "
            f"{k['cubin_bytes']} bytes of CUBIN"
            + (f", loaded from {k['loaded_from']}" if k.get("loaded_from") else "")
            + "):"
        )
        for name, r in k["functions"].items():
            lines.append(
                f"  {name}: {r['registers']} registers, {r['shared_bytes']} B shared, "
                f"{r['spill_bytes']} B spilled, {r['stack_bytes']} B stack"
            )
    lines += [f"note: {n}" for n in report["notes"]]
    lines += [f"PROBLEM: {p}" for p in report["problems"]]
    lines.append(
        "a CUDA run would work here"
        if report["cuda_ready"]
        else f"a CUDA run would fail here ({len(report['problems'])} problem(s) above)"
    )
    return "\n".join(lines)
