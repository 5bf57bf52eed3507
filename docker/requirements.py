"""Print the project's requirements (core + the named extras) from pyproject.toml.

The images install the dependencies in a layer of their own, before the source
is copied, so that editing the source does not re-install them. Reading the
list from pyproject.toml means that layer never builds the project itself: no
placeholder package is ever built, so none can be packaged later by mistake.

    python3 docker/requirements.py service vllm-cuda > /tmp/requirements.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"error: unknown extra(s) {unknown}; pyproject has {sorted(optional)}")
    lines = list(project["dependencies"])
    for name in extras:
        lines += optional[name]
    return lines


if __name__ == "__main__":
    lines = requirements(Path("pyproject.toml"), sys.argv[1:])  # run where pyproject.toml is
    sys.stdout.write("".join(f"{line}\n" for line in lines))
