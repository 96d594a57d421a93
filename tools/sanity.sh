#!/usr/bin/env bash
# The Ansible ecosystem's own checks of the collection: `ansible-test sanity` on the venv's
# Python, without Docker, and `antsibull-docs lint-collection-docs`. Part of `make lint`.
#
# Needs the venv (`make venv`: ansible-core, antsibull-docs and shellcheck, pinned) and the
# package index: ansible-test runs each sanity test in a virtualenv of its own, made on the
# first run from its pinned requirement files and kept under ~/.ansible/test/venv.
# Findings that stay are listed, each with its reason, in tests/sanity/ignore-X.Y.txt (one
# file per ansible-core version).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
tools/collection-link.sh
collection=$PWD/.cache/collections/ansible_collections/cardshare/gpuhost
python=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# ansible-test bootstraps pip into each sanity virtualenv with a script it downloads from a
# host outside the package registries; put an equivalent one, made from pip's wheel, in place.
python tools/ansible_test_pip.py
if ! command -v shellcheck >/dev/null; then
  echo "sanity: shellcheck is missing (it comes with the venv: make venv)" >&2
  exit 1
fi

# ansible-test finds the collection by its path, .../ansible_collections/cardshare/gpuhost,
# which only the link has; it reads the real directory from the cwd, so it is told the path.
cd "$collection"
export ANSIBLE_TEST_CONTENT_ROOT=$collection
sanity() { ansible-test sanity --local --python "$python" "$@"; }
status=0
# Every test on every file, except:
# - changelog: lint.sh runs antsibull-changelog lint, with the project's pinned version;
# - pylint, run below on plugins/ only. The rest of the Python (src/, tests/, lab/, tools/,
#   benchmarks/) is not Ansible plugin code: ruff and mypy (strict) check it, and
#   ansible-test's pylint rules for plugins (no `_` as a throwaway name, among others) are
#   not its conventions. On the whole checkout pylint alone takes minutes on two cores.
sanity --skip-test changelog --skip-test pylint || status=1
sanity --test pylint plugins/ || status=1
echo "sanity: antsibull-docs lint-collection-docs"
antsibull-docs lint-collection-docs --plugin-docs \
  --validate-collection-refs=dependent --disallow-unknown-collection-refs . || status=1
exit $status
