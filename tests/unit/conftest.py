"""Unit tests. Loading this file puts ``tests/unit`` on ``sys.path`` (pytest's ``prepend``
import mode), so the shared helpers beside it (``promtext``, ``slow_clients``) import from
every test directory, whichever subset runs."""
