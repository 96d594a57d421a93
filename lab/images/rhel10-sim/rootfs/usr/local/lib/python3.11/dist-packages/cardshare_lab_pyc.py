"""LAB ONLY, not a simulation: a bytecode cache for the Python that Ansible ships per task.

Every task Ansible runs on a host sends its module and module_utils as a zip
(``ansible_<module>_payload.zip``) that Python imports with ``zipimport``, which compiles
every source file on every run and keeps nothing: about 0.2 s of CPU per task on the lab
host, where the scenarios run three at a time on two cores. This hook keeps the compiled
code of those payloads, keyed on the file's path inside the zip and its source, under
``/var/cache/cardshare-lab/ansible-pyc``; the code that runs is the code that was sent.
Any other zip (the cardshare zipapp included) is compiled as usual, and any failure to read
or write the cache falls back to compiling. It is loaded by ``cardshare-lab-pyc.pth`` and
exists only in the lab host's image.
"""

import marshal
import os
import sys
import zipimport

_DIR = "/var/cache/cardshare-lab/ansible-pyc"
_MARK = "_payload.zip" + os.sep
_compile_source = zipimport._compile_source  # the one function zipimport compiles with


def _with_filename(code, filename):
    """The code object (and the functions and classes in it) as compiled from filename."""
    consts = tuple(
        _with_filename(c, filename) if isinstance(c, type(code)) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def _cached_compile_source(pathname, source):
    at = pathname.find(_MARK)
    if at < 0:
        return _compile_source(pathname, source)
    import hashlib

    inner = pathname[at + len(_MARK) :].encode()
    key = hashlib.sha256(inner + b"\0" + source).hexdigest()
    path = os.path.join(_DIR, f"{key}.{sys.implementation.cache_tag}")
    try:
        with open(path, "rb") as f:
            return _with_filename(marshal.loads(f.read()), pathname)
    except (OSError, ValueError, EOFError, TypeError):
        pass
    code = _compile_source(pathname, source)
    try:
        os.makedirs(_DIR, mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(marshal.dumps(code))
        os.replace(tmp, path)
    except OSError:
        pass
    return code


zipimport._compile_source = _cached_compile_source
