"""docs/architecture.md: everything is spelled ringleader.*; imports flow hostctl -> ipc <- device;
the server and the gateway never load the device's code (a backend reaches the server through
ringleader.ipc.backend.Backend, opened by a command), the engine never imports zmq, the server or
the gateway, the product reaches the bench only when `ringleader bench` runs, and nothing shipped
reaches the lab (bench/lab/, which is not in the wheel).

The static checks read every file's imports (deferred ones included); the dynamic ones import a
module in a fresh interpreter and look at what sys.modules holds afterwards, so an import made
through any chain of modules counts, whichever file makes it."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("ipc", "hostctl", "device", "bench")


def _sources(*folders: str) -> list[Path]:
    return [p for f in folders for p in (ROOT / f).rglob("*.py") if "results" not in p.parts]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return "ringleader." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_names(path: Path) -> list[str]:
    """Every absolute module name a file imports, deferred imports included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_every_import_is_spelled_in_the_ringleader_namespace():
    """A checkout also finds ipc/, device/... as top-level names; an installed wheel does not."""
    bare = [
        f"{p.relative_to(ROOT)}: {name}"
        for p in _sources(*FOLDERS, "tests")
        for name in _import_names(p)
        if name.split(".")[0] in FOLDERS
    ]
    assert not bare, bare


def test_ipc_imports_neither_hostctl_nor_device():
    for path in _sources("ipc"):
        names = _import_names(path)
        assert not [n for n in names if n.startswith(("ringleader.hostctl", "ringleader.device"))], path


def test_device_never_imports_hostctl_or_zmq():
    for path in _sources("device"):
        names = _import_names(path)
        assert not [n for n in names if n.startswith("ringleader.hostctl") or n.split(".")[0] == "zmq"], path


def test_nothing_shipped_imports_the_lab():
    """bench/lab/ is not in the wheel: ipc, hostctl, device and the shipped bench never name it
    (the lab imports whatever it measures; nothing imports the lab but the lab and the tests)."""
    shipped = [p for p in _sources(*FOLDERS) if "lab" not in p.relative_to(ROOT).parts]
    users = {
        _module_name(p): n for p in shipped for n in _import_names(p) if n.startswith("ringleader.bench.lab")
    }
    assert shipped and not users, users


def test_the_engine_never_imports_the_server_the_gateway_or_the_command_line():
    """device/ reaches hostctl not at all (test above); and nothing below the server, in ipc/,
    imports the command line either: a library does not depend on the CLI."""
    cli_users = {
        _module_name(p)
        for p in _sources("ipc", "device", "hostctl")
        if any(
            n.startswith("ringleader.hostctl.commands") or n == "ringleader.hostctl.cli"
            for n in _import_names(p)
        )
        and not _module_name(p).startswith(("ringleader.hostctl.commands", "ringleader.hostctl.cli"))
    }
    assert not cli_users, cli_users


def test_only_commands_reach_into_the_device():
    """hostctl's server and gateway see a backend through ipc.backend.Backend; the commands that
    open one (serve, doctor, build-kernel) are the only hostctl modules that name the device, but
    for the engine's option declarations (device.engine_config, which loads no torch:
    tests/test_config_options.py), which the Ray Serve app checks before it passes them to the engines it starts."""
    users = {
        _module_name(p)
        for p in _sources("hostctl")
        if any(
            n.startswith("ringleader.device") and not n.startswith("ringleader.device.engine_config")
            for n in _import_names(p)
        )
    }
    assert users and all(m.startswith("ringleader.hostctl.commands.") for m in users), users
    config_users = {
        _module_name(p)
        for p in _sources("hostctl")
        if any(n.startswith("ringleader.device.engine_config") for n in _import_names(p))
    }
    assert {m for m in config_users if not m.startswith("ringleader.hostctl.commands.")} == {
        "ringleader.hostctl.ray_serve.args"
    }


def test_the_product_names_the_bench_in_one_place():
    """ipc, hostctl and device never import the bench, but for `ringleader bench` itself."""
    users = {
        _module_name(p)
        for p in _sources("ipc", "hostctl", "device")
        if any(n.startswith("ringleader.bench") for n in _import_names(p))
    }
    assert users == {"ringleader.hostctl.commands.bench"}, users


def _loaded_after(statement: str) -> set[str]:
    """The module names sys.modules holds after `statement` runs in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "module",
    [
        "ringleader.hostctl.serving.server",
        "ringleader.hostctl.serving.prometheus",
        "ringleader.hostctl.gateway.app",
    ],
)
def test_the_server_and_the_gateway_load_no_device_code_and_no_torch(module):
    pytest.importorskip("aiohttp")
    loaded = _loaded_after(f"import {module}")
    assert module in loaded
    assert not {m for m in loaded if m.startswith("ringleader.device") or m.split(".")[0] == "torch"}


def test_the_command_line_reaches_the_bench_and_torch_only_when_asked():
    """Building the parser (every `--help`, every command before it runs) loads neither the bench
    nor torch: `ringleader generate` and `stats` start in a fraction of a second."""
    loaded = _loaded_after("from ringleader.hostctl.cli import build_parser; build_parser()")
    assert "ringleader.hostctl.cli" in loaded
    assert not {m for m in loaded if m.startswith("ringleader.bench") or m.split(".")[0] == "torch"}


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`, which never run: an annotation's
    import is no dependency (a step names the model class it is built by only as a type)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports at run time (anywhere in it, deferred imports included)."""
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
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
    files = {_module_name(p): p for p in _sources(*FOLDERS)}
    known = set(files)
    graph = {m: _imported_modules(p, known) - {m} for m, p in files.items()}
    # a package's __init__ that re-exports its modules is not a dependency of those modules
    graph = {
        m: {n for n in deps if not (files[n].name == "__init__.py" and m.startswith(n + "."))}
        for m, deps in graph.items()
    }
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
