"""DESIGN.md: imports flow hostctl -> ipc <- device; hostctl reaches the device only through the
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
