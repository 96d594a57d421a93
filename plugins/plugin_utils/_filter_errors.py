# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one way the collection's filters report a computation's error to Ansible."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]

_R = TypeVar("_R")


def filter_errors(
    error: type[Exception],
) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """A decorator that turns ``error`` raised by a filter's function into
    ``AnsibleFilterError`` with the same message."""

    def decorate(func: Callable[..., _R]) -> Callable[..., _R]:
        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> _R:
            try:
                return func(*args, **kwargs)
            except error as err:
                raise AnsibleFilterError(str(err), orig_exc=err) from err

        return wrapper

    return decorate
