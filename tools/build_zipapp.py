"""Build ``cardshare.pyz``: the recorder as one file, standard library only.

Usage: ``python tools/build_zipapp.py OUTPUT``

Only the host command's modules are packed (``MODULES`` below: the recorder,
``cardshare bench retrieval``, ``cardshare ratchet`` and ``cardshare proxy key``); each is
checked to import nothing but the standard library and other packed modules, so the archive
runs on a bare ``python3`` (3.11 or newer).  Entry point ``cardshare.cli:main``, shebang
``/usr/bin/env python3``.

The archive is reproducible: members in name order with a fixed timestamp and modes, so the
same sources give the same bytes (copying it to a host again reports no change).  Its
``__main__.py`` exits with the status ``main()`` returns: the one ``zipapp`` would generate
for ``main="pkg.mod:fn"`` drops it, so every failure would exit 0 and a failed scan would
look like a success to systemd.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import tempfile
import zipfile
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "cardshare"
MODULES = (
    "__init__.py",
    "__main__.py",
    "atomicfile.py",
    "campaign/__init__.py",
    "campaign/summary.py",
    "cli/__init__.py",
    "cli/arbiter.py",
    "cli/bench.py",
    "cli/campaign.py",
    "cli/common.py",
    "cli/ratchet.py",
    "cli/recorder.py",
    "docker_api.py",
    "fdinfo.py",
    "naming.py",
    "promtext.py",
    "proxy/__init__.py",
    "proxy/keys.py",
    "proxy/keytool.py",
    "recorder/__init__.py",
    "recorder/compute.py",
    "recorder/openfiles.py",
    "recorder/output.py",
    "recorder/procfs.py",
    "recorder/report.py",
    "recorder/results.py",
    "recorder/scan.py",
    "retrieval/__init__.py",
    "retrieval/arm.py",
    "retrieval/bench.py",
    "retrieval/inflight.py",
    "retrieval/ratchet.py",
    "retrieval/record.py",
    "retrieval/resident.py",
    "retrieval/wire.py",
    "sqlitestore.py",
)
PACKED = {"cardshare", "cardshare.recorder", "cardshare.campaign"} | {
    "cardshare." + m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    for m in MODULES
}


SHEBANG = b"#!/usr/bin/env python3\n"
ENTRY = b"import sys\n\nfrom cardshare.cli import main\n\nsys.exit(main())\n"
FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip member can carry
FILE_ATTR = 0o100644 << 16
UNIX = 3


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


def archive(members: dict[str, bytes]) -> bytes:
    """The zipapp's bytes: shebang, then the members in name order with fixed metadata."""
    out = io.BytesIO()
    out.write(SHEBANG)
    with zipfile.ZipFile(out, "w") as zf:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
            info.create_system = UNIX
            info.external_attr = FILE_ATTR
            zf.writestr(info, members[name], compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return out.getvalue()


def build(output: Path, src: Path = SRC) -> Path:
    """Write the archive to ``output`` atomically (mode 0755) and return it."""
    members = {"__main__.py": ENTRY}
    for module in MODULES:
        source_path = src / module
        source = source_path.read_text(encoding="utf-8")
        bad = foreign_imports(source, str(source_path))
        if bad:
            raise BuildError(f"{module} imports outside the standard library: {bad}")
        members[f"cardshare/{module}"] = source.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(archive(members))
        os.chmod(tmp, 0o755)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
