"""The `kvspec` command's launcher: checks that the project's packages are the ones that
import, then runs `statemachine.cli`.

The project's top-level packages share their import names with two PyPI packages:
`statemachine` with python-statemachine, `kernels` with Hugging Face's kernels. Installed in
the same environment, one overwrites the other's files. This module has a name of its own,
so it can say so in one line instead of failing inside an import.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

CLASHING = {"statemachine": "python-statemachine", "kernels": "kernels"}
"""Our package -> the PyPI distribution that ships a package of the same import name."""


def import_clash() -> str | None:
    """A one-line explanation if another distribution's package shadows one of ours."""
    here = importlib.util.find_spec("spec")
    home = Path(here.origin).resolve().parent.parent if here and here.origin else None
    for package, dist in CLASHING.items():
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = False
        else:
            installed = True
        found = importlib.util.find_spec(package)
        origin = Path(found.origin).resolve().parent.parent if found and found.origin else None
        if installed or origin != home:
            return (f"the package {dist!r} (import name {package!r}) is installed beside "
                    f"kvoffload-spec, which has a package of the same name; install "
                    f"kvoffload-spec in an environment without it (a fresh venv)")
    return None


def main() -> int:
    clash = import_clash()
    if clash:
        print(f"kvspec: {clash}", file=sys.stderr)
        return 2
    from statemachine.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
