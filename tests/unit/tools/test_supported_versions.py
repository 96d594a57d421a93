"""The versions the collection promises are the ones its tests run: ``requires_ansible``
(meta/runtime.yml), each role's ``min_ansible_version`` and galaxy.yml's collection floors
equal what requirements-dev.txt pins (ansible-core, and the collections the pinned ``ansible``
package carries, read from the installed package as the tests run it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ansible_collections
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def pinned(name: str) -> str:
    text = (ROOT / "requirements-dev.txt").read_text()
    found = re.search(rf"^{re.escape(name)}==(\S+)$", text, re.M)
    assert found, f"requirements-dev.txt pins no {name}"
    return found.group(1)


def installed_collection(fqcn: str) -> str:
    namespace, name = fqcn.split(".")
    for base in ansible_collections.__path__:
        manifest = Path(base) / namespace / name / "MANIFEST.json"
        if manifest.is_file():
            return str(json.loads(manifest.read_text())["collection_info"]["version"])
    pytest.fail(f"{fqcn} is not installed (the pinned ansible package carries it)")


def test_requires_ansible_is_the_tested_ansible_core() -> None:
    runtime = yaml.safe_load((ROOT / "meta/runtime.yml").read_text())
    assert runtime["requires_ansible"] == f">={pinned('ansible-core')}"


def test_each_roles_minimum_is_the_tested_minor() -> None:
    minor = ".".join(pinned("ansible-core").split(".")[:2])
    for meta in sorted(ROOT.glob("roles/*/meta/main.yml")):
        info = yaml.safe_load(meta.read_text())["galaxy_info"]
        assert info["min_ansible_version"] == minor, meta


def test_collection_floors_are_the_tested_versions() -> None:
    dependencies = yaml.safe_load((ROOT / "galaxy.yml").read_text())["dependencies"]
    assert dependencies, "galaxy.yml lists no dependencies"
    for fqcn, floor in dependencies.items():
        assert floor == f">={installed_collection(fqcn)}", fqcn
