"""Gives ansible-test the pip bootstrap script it would otherwise download.

ansible-test runs each sanity test in a virtualenv of its own, created without pip, and
bootstraps pip there with a ``get-pip.py`` it downloads from a host outside the package
registries (it says so, and where to put the script, when the download fails). This writes
an equivalent script to that place, made from the pip wheel that ansible-test asks for,
fetched from the package index with pip itself. A script already there is kept.

Run with the project venv's Python (the one that has ansible-core).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

MARK = "made by cardshare.gpuhost's tools/ansible_test_pip.py"
# What get-pip.py does with its arguments: drop its own two options, install the rest.
BOOTSTRAP = '''\
"""pip bootstrap for ansible-test's sanity virtualenvs, {mark}
from the pip {version} wheel beside it (does what get-pip.py does)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "{wheel}"))

from pip._internal.cli.main import main  # noqa: E402

args = [arg for arg in sys.argv[1:] if arg not in ("--no-setuptools", "--no-wheel")]
sys.exit(main(["install", "--upgrade", "--force-reinstall", *args]))
'''


def pip_version() -> str:
    """The pip version ansible-test bootstraps into its sanity virtualenvs."""
    from ansible_test._internal.host_configs import NativePythonConfig
    from ansible_test._internal.python_requirements import get_venv_packages

    version = "{}.{}".format(*sys.version_info[:2])
    return str(get_venv_packages(NativePythonConfig(version=version, path=sys.executable))["pip"])


def main() -> int:
    version = pip_version()
    cache = Path.home() / ".ansible" / "test" / "cache"
    script = cache / f"get_pip_{version.replace('.', '_')}.py"
    wheel = cache / f"pip-{version}-py3-none-any.whl"
    # ansible-test's own script (downloaded where that host answers), or ours with its wheel
    if script.exists() and (wheel.exists() or MARK not in script.read_text()):
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    if not wheel.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
            download = ["download", "--no-deps", "--only-binary=:all:", "--dest", tmp]
            subprocess.run([*pip, *download, f"pip=={version}"], check=True)
            Path(tmp, wheel.name).rename(wheel)
    partial = script.with_suffix(".partial")
    partial.write_text(BOOTSTRAP.format(mark=MARK, version=version, wheel=wheel.name))
    partial.rename(script)
    print(f"ansible-test: pip {version} bootstrap script written from the wheel on the index")
    return 0


if __name__ == "__main__":
    sys.exit(main())
