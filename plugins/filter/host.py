# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one rule for paths under ``cardshare_host_root``.

``cardshare_host_root`` is ``/`` on a real host and, in the lab, the directory that holds a
simulated GPU's sysfs and dev tree.  Every role that reads or mounts a host path under it
goes through :func:`host_path`, documented in ``host_path.yml`` beside this file.
"""

from __future__ import annotations

from collections.abc import Callable

from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]

_ROOT_FIX = (
    "set it (cardshare_host_root, or the role's *_host_root) to / on a real host, or to the "
    "simulated tree's absolute directory in the lab"
)
_PATH_FIX = "give it as the host itself sees it, from its root (e.g. '/dev/dri')"


def _root(root: object) -> str:
    """``root`` without trailing slashes; ``/`` stays ``/``."""
    if root is None or root == "":
        raise AnsibleFilterError(f"host_path: the host root is empty ({root!r}); {_ROOT_FIX}")
    if not isinstance(root, str):
        raise AnsibleFilterError(
            f"host_path: the host root must be a string, got {type(root).__name__} {root!r}; "
            f"{_ROOT_FIX}"
        )
    if not root.startswith("/"):
        raise AnsibleFilterError(f"host_path: the host root {root!r} is not absolute; {_ROOT_FIX}")
    return root.rstrip("/") or "/"


def _under(root: str, path: object) -> str:
    """``path`` under the normalised ``root``."""
    if not isinstance(path, str):
        raise AnsibleFilterError(
            f"host_path: the path must be a string or a list of strings, got "
            f"{type(path).__name__} {path!r}; {_PATH_FIX}"
        )
    if not path.startswith("/"):
        raise AnsibleFilterError(f"host_path: the path {path!r} is not absolute; {_PATH_FIX}")
    if root == "/":
        return path
    if path.strip("/") == "":
        return root
    return root + path


def host_path(root: object, path: object = None) -> str | list[str]:
    """The host path of ``path`` under ``root``, or ``root`` itself without ``path``.

    ``root`` loses its trailing slashes (``/`` stays ``/``); ``path`` is appended as given.
    Under ``/`` the path is the path itself.  A list of paths gives the list of their host
    paths, so a list of devices maps in one call.
    """
    base = _root(root)
    if path is None:
        return base
    if isinstance(path, (list, tuple)):
        return [_under(base, item) for item in path]
    return _under(base, path)


class FilterModule:
    """cardshare.gpuhost host filters."""

    def filters(self) -> dict[str, Callable[..., object]]:
        return {"host_path": host_path}
