#!/usr/bin/env bash
# `make test`: everything, from a bare machine. Installs what is missing, starts a Docker
# engine of the project's own when none answers (and stops only that one at the end),
# builds the lab images it lacks (cached by recipe hash), then runs lint, unit tests and
# every molecule scenario. Exits non-zero when anything fails.
set -uo pipefail
cd "$(dirname "$0")/.."
started_engine=0
cleanup() {
  if [ "$started_engine" = 1 ]; then lab/scripts/engine.sh stop; fi
}
trap cleanup EXIT

step() { echo; echo "==> $*"; }
fail() { echo "make test: FAILED at: $*" >&2; exit 1; }

step "dependencies"; tools/deps.sh || fail deps
step "virtualenv"; tools/venv.sh || fail venv
tools/collection-link.sh
export PATH="$PWD/.venv/bin:$PATH"

if [ -z "${SKIP_STATIC:-}" ]; then
  step "lint"; tools/lint.sh || fail lint

  step "unit tests"
  pytest -q -p no:cacheprovider; rc=$?
  # pytest exits 5 when it collected nothing: that is a failure here, not a pass
  [ $rc = 0 ] || fail "unit tests (pytest exit $rc)"
fi

step "lab engine"
# stop at the end only an engine this run started
if ! DOCKER_HOST=$(lab/scripts/engine.sh host) timeout 10 docker info >/dev/null 2>&1; then
  lab/scripts/engine.sh start || fail engine
  started_engine=1
fi
DOCKER_HOST=$(lab/scripts/engine.sh host); export DOCKER_HOST
echo "engine: DOCKER_HOST=$DOCKER_HOST"

step "lab images"; lab/scripts/images.sh || fail images

step "molecule"
export MOLECULE_GLOB='molecule/*/molecule.yml'
scenarios=${SCENARIOS:-$(for f in molecule/*/molecule.yml; do basename "$(dirname "$f")"; done)}
for s in $scenarios; do
  step "molecule test -s $s"
  molecule test -s "$s" || fail "molecule scenario $s"
done
echo; echo "make test: all passed"
