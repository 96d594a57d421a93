"""Make the collection importable as ``ansible_collections.cardshare.gpuhost`` in unit tests.

Ansible imports plugins by their collection path.  The checkout is linked into
``.cache/collections/ansible_collections/cardshare/gpuhost`` (the same tree that
``ansible.cfg`` puts on the collections path) and that root is put on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLLECTIONS = ROOT / ".cache" / "collections"
LINK = COLLECTIONS / "ansible_collections" / "cardshare" / "gpuhost"

if not LINK.exists():
    LINK.parent.mkdir(parents=True, exist_ok=True)
    LINK.symlink_to(ROOT, target_is_directory=True)
if str(COLLECTIONS) not in sys.path:
    sys.path.insert(0, str(COLLECTIONS))
