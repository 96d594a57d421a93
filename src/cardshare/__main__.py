"""``python -m cardshare``: the recorder's command line."""

from cardshare.cli import main

raise SystemExit(main())
