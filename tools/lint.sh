#!/usr/bin/env bash
# Every static check: yamllint, ansible-lint (production profile), ruff, mypy, the
# argument-spec/defaults/README agreement, and the changelog fragments.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
status=0
run() { echo "lint: $*"; "$@" || status=1; }
run yamllint --strict .
run ansible-lint --offline -q
run ruff check .
run ruff format --check .
run mypy
MYPYPATH=.cache/collections run mypy --explicit-package-bases plugins/filter plugins/modules
run python tools/role_docs.py --check
run antsibull-changelog lint
exit $status
