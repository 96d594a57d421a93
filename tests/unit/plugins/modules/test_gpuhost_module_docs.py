"""The modules' documentation parses and agrees with their argument specs."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from ansible.utils.plugin_docs import add_fragments  # type: ignore[import-untyped]
from ansible_collections.cardshare.gpuhost.plugins.doc_fragments import attributes
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_gather import probe_self_fdinfo
from ansible_collections.cardshare.gpuhost.plugins.modules import kernel_info, xe_driver_info

# The doc fragments the modules extend, by the name they give in extends_documentation_fragment.
FRAGMENTS = {"cardshare.gpuhost.attributes": attributes.ModuleDocFragment}


class _FragmentLoader:
    """The collection's doc fragments, by name, for Ansible's own ``add_fragments``."""

    def get(self, name: str) -> SimpleNamespace | None:
        fragment = FRAGMENTS.get(name)
        if fragment is None:
            return None
        sections = {k: v for k, v in vars(fragment).items() if k.isupper()}
        return SimpleNamespace(ansible_name=name, **sections)


def _documentation(module: ModuleType) -> dict[str, Any]:
    """The module's DOCUMENTATION with its fragments merged, as ansible-doc shows it."""
    doc: dict[str, Any] = yaml.safe_load(module.DOCUMENTATION)
    add_fragments(doc, module.__file__, _FragmentLoader(), is_module=True)
    return doc


@pytest.mark.parametrize("module", [xe_driver_info, kernel_info], ids=lambda m: m.__name__)
def test_documentation_matches_argument_spec(module: ModuleType) -> None:
    doc = _documentation(module)
    yaml.safe_load(module.EXAMPLES)
    yaml.safe_load(module.RETURN)
    options = doc["options"]
    spec = module.ARGUMENT_SPEC
    assert sorted(options) == sorted(spec)
    for name, option in options.items():
        assert option["type"] == spec[name]["type"], name
        assert option.get("default") == spec[name].get("default"), name
        assert option.get("elements") == spec[name].get("elements"), name
        assert option.get("aliases") == spec[name].get("aliases"), name
    assert {a: doc["attributes"][a]["support"] for a in doc["attributes"]} == {
        "check_mode": "full",
        "diff_mode": "none",
        "idempotent": "full",
    }
    assert all(attribute["description"] for attribute in doc["attributes"].values())


@pytest.mark.parametrize(
    ("path", "has_text", "error"),
    [
        ("/dev/null", True, None),
        (
            "/nonexistent/renderD128",
            False,
            "cannot open /nonexistent/renderD128: No such file or directory",
        ),
    ],
)
def test_probe_self_fdinfo(path: str, has_text: bool, error: str | None) -> None:
    text, err = probe_self_fdinfo(path)
    assert (text is not None, err) == (has_text, error)
    if text is not None:
        assert "flags:" in text
