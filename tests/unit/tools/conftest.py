"""Put ``tools/`` on ``sys.path`` so the tests import ``role_docs`` as the CLI runs it."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[3] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
