# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters for the patient proxy: thin shells over ``plugin_utils._proxy_boxes``.

Each filter is documented in its own ``<filter name>.yml`` beside this file; errors become
``AnsibleFilterError`` with the message naming the variable, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._filter_errors import filter_errors
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._proxy_boxes import (
    BoxError,
    proxy_boxes,
)


@filter_errors(BoxError)
def proxy_boxes_filter(settings: object) -> list[dict[str, Any]]:
    if not isinstance(settings, Mapping):
        raise AnsibleFilterError(
            f"proxy_boxes: expected the arbiter role's settings (a mapping), got "
            f"{type(settings).__name__}"
        )
    return proxy_boxes(settings)


class FilterModule:
    """The arbiter role's filters for the patient proxy."""

    def filters(self) -> dict[str, Callable[..., object]]:
        return {"proxy_boxes": proxy_boxes_filter}
