"""The retrieval tier's Python, standard library only: the recorder's zipapp packs it, so both
commands run on a bare ``python3`` beside the server.

- ``cardshare bench retrieval``: :mod:`.bench` runs it, with the record it writes
  (:mod:`.record`), what it sends and how it reads the answers (:mod:`.wire`) and the check of
  the arm (:mod:`.arm`);
- ``cardshare ratchet``, the watchdog: :mod:`.ratchet` decides and acts on the resident memory
  (:mod:`.resident`) and the requests in flight (:mod:`.inflight`).
"""
