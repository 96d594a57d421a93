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

# the collection builds, and build_ignore keeps caches and local state out of the tarball
build_check() {
  local out
  out=$(mktemp -d)
  ansible-galaxy collection build --force --output-path "$out" >/dev/null || { rm -rf "$out"; return 1; }
  if tar tzf "$out"/cardshare-gpuhost-*.tar.gz | grep -E '^(\.cache|\.venv|\.hypothesis|\.pytest_cache)/|egg-info/'; then
    echo "collection build: the tarball carries local state (see above)" >&2; rm -rf "$out"; return 1
  fi
  rm -rf "$out"
}
run build_check
exit $status
