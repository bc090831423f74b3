"""What to type to get an optional dependency: the packages of one of ringleader's extras, read
from the installed distribution's metadata (written once, in pyproject.toml).

`pip install "ringleader[http]"` would name a distribution that is not published (and that
someone else could publish), so a hint names the packages themselves, and the extra for those
who work from a checkout."""

from __future__ import annotations

import re
import shlex
from importlib import metadata

DISTRIBUTION = "ringleader"


def packages_of_extra(extra: str) -> list[str]:
    """The requirements the extra adds, e.g. ['aiohttp>=3.9', 'prometheus-client>=0.20'];
    [] when the distribution's metadata cannot be read."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for line in requires:
        requirement, _, marker = line.partition(";")
        if re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker):
            out.append(requirement.strip().replace(" ", ""))
    return out


def install_hint(extra: str) -> str:
    packages = packages_of_extra(extra)
    checkout = f'from a ringleader checkout: pip install -e ".[{extra}]"'
    if not packages:
        return checkout
    return f"pip install {' '.join(shlex.quote(p) for p in packages)} ({checkout})"
