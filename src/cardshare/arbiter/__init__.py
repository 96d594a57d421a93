"""The arbiter: the card's owner-of-record, trading the whole card between vLLM and ComfyUI.

Modules: ``config`` (the JSON config, validated), ``states`` (modes, phases, transitions
as data), ``rules`` (pure decisions), ``resume`` (pure restart plans), ``cardview`` (the
recorder's data), ``store`` (SQLite), ``edges`` (containers and HTTP services),
``engine`` (runs the machine), ``api`` (HTTP), ``metrics`` (Prometheus text).
Run it with ``python -m cardshare.arbiter --config FILE``.
"""
