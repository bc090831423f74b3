"""docs/architecture.md: imports flow hostctl -> ipc <- device; hostctl reaches the device only through the
backend interface (opened in one place, hostctl/cli.py), and the engine never imports zmq."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_ipc_imports_neither_hostctl_nor_device():
    for path in (ROOT / "ipc").rglob("*.py"):
        assert not imported_packages(path) & {"hostctl", "device"}, path


def test_device_never_imports_hostctl_or_zmq():
    for path in (ROOT / "device").rglob("*.py"):
        assert not imported_packages(path) & {"hostctl", "zmq"}, path


def test_hostctl_opens_the_device_in_one_place():
    users = [p.name for p in (ROOT / "hostctl").rglob("*.py") if "device" in imported_packages(p)]
    assert users == ["cli.py"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports (anywhere in it, deferred imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            # `from pkg import submodule` depends on the submodule; `from pkg import name`, on pkg
            candidates = submodules if len(submodules) == len(node.names) else [node.module, *submodules]
        else:
            continue
        out |= {c for c in candidates if c in known}
    return out


def test_no_import_cycles():
    """No two modules import each other, directly or through others (packages' __init__ aside:
    importing ipc.x imports ipc, which is not a dependency of the design)."""
    files = {
        _module_name(p): p
        for pkg in ("ipc", "hostctl", "device", "bench")
        for p in (ROOT / pkg).rglob("*.py")
    }
    known = set(files)
    graph = {m: _imported_modules(p, known) - {m} for m, p in files.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
