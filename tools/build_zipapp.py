"""Build ``cardshare.pyz``: the recorder as one file, standard library only.

Usage: ``python tools/build_zipapp.py OUTPUT``

Only the recorder's modules are packed (``MODULES`` below); each is checked to import nothing
but the standard library and other packed modules, so the archive runs on a bare
``python3`` (3.11 or newer).  Entry point ``cardshare.cli:main``, shebang
``/usr/bin/env python3``.
"""

from __future__ import annotations

import ast
import shutil
import sys
import tempfile
import zipapp
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "cardshare"
MODULES = (
    "__init__.py",
    "__main__.py",
    "cli.py",
    "docker_api.py",
    "fdinfo.py",
    "naming.py",
    "procscan.py",
    "recorder/__init__.py",
    "recorder/compute.py",
    "recorder/output.py",
    "recorder/report.py",
)
PACKED = {"cardshare", "cardshare.recorder"} | {
    "cardshare." + m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    for m in MODULES
}


class BuildError(Exception):
    pass


def foreign_imports(source: str, filename: str) -> list[str]:
    """Imports of a module that are neither standard library nor packed modules."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top == "cardshare":
                if name not in PACKED:
                    bad.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                bad.append(name)
    return bad


def build(output: Path, src: Path = SRC) -> Path:
    """Write the archive to ``output`` and return it."""
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "cardshare"
        for module in MODULES:
            source_path = src / module
            source = source_path.read_text(encoding="utf-8")
            bad = foreign_imports(source, str(source_path))
            if bad:
                raise BuildError(f"{module} imports outside the standard library: {bad}")
            target = package / module
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source_path, target)
        zipapp.create_archive(
            tmp,
            target=output,
            interpreter="/usr/bin/env python3",
            main="cardshare.cli:main",
            compressed=True,
        )
    return output


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python tools/build_zipapp.py OUTPUT", file=sys.stderr)
        return 2
    try:
        path = build(Path(argv[0]))
    except (BuildError, OSError) as exc:
        print(f"build_zipapp: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
