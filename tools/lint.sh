#!/usr/bin/env bash
# Every static check: yamllint, ansible-lint (production profile), ruff, mypy, the
# argument-spec/defaults/README agreement, the changelog fragments, ansible-test sanity and
# antsibull-docs (tools/sanity.sh), and the collection tarball's file list.
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
run tools/sanity.sh

# The collection builds, and build_ignore keeps the tarball to what users run: no local
# state, tests, lab or development tooling; and what the roles need is in it.
# shellcheck disable=SC2329  # called through run
build_check() {
  local out files unwanted missing=() path
  out=$(mktemp -d)
  ansible-galaxy collection build --force --output-path "$out" >/dev/null || { rm -rf "$out"; return 1; }
  files=$(tar tzf "$out"/cardshare-gpuhost-*.tar.gz)
  rm -rf "$out"
  unwanted=$(grep -E '^(\.[^/]+|tests|molecule|lab|benchmarks|inventories/lab)(/|$)|__pycache__/|egg-info/|^(Makefile|ansible\.cfg|requirements-dev\.txt)$|^tools/' <<<"$files" \
    | grep -vx 'tools/\|tools/build_zipapp\.py' || true)
  for path in README.md meta/runtime.yml playbooks/site.yml inventories/example/hosts.yml \
      pyproject.toml src/cardshare/cli/__init__.py tools/build_zipapp.py \
      roles/arbiter/files/Dockerfile extras/prometheus/cardshare.rules.yml \
      extras/grafana/cardshare.json; do
    grep -qx "$path" <<<"$files" || missing+=("$path")
  done
  if [ -n "$unwanted" ]; then
    echo "collection build: the tarball carries development files:" >&2; echo "$unwanted" >&2
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "collection build: the tarball lacks ${missing[*]}" >&2
  fi
  [ -z "$unwanted" ] && [ ${#missing[@]} = 0 ]
}
run build_check
exit $status
