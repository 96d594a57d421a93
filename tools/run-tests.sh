#!/usr/bin/env bash
# `make test`: everything, from a bare machine. Installs what is missing, starts a Docker
# engine of the project's own when none answers (and stops only that one at the end),
# builds the lab images it lacks (cached by recipe hash), then runs lint, unit tests and
# every molecule scenario. Exits non-zero when anything fails.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
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

faults_pid=""
if [ -z "${SKIP_STATIC:-}" ]; then
  # The arbiter's fault injection (tests/faults: real processes on 127.0.0.1) runs beside the
  # scenarios, which mostly wait on boots and timers; its result is read at the end.
  step "fault injection (in the background; log in .cache/faults.log)"
  mkdir -p .cache
  ( pytest -q -p no:cacheprovider tests/faults -m "faults and not faults_random" \
    && FAULTS_RANDOM_SEED=${FAULTS_RANDOM_SEED:-20261201} \
       pytest -q -p no:cacheprovider -s tests/faults -m faults_random ) >.cache/faults.log 2>&1 &
  faults_pid=$!
fi

step "molecule"
export MOLECULE_GLOB='molecule/*/molecule.yml'
# each task timed in the logs, the slowest listed at the end of each play run
export ANSIBLE_CALLBACKS_ENABLED=${ANSIBLE_CALLBACKS_ENABLED:-ansible.posix.profile_tasks}
# Scenarios run side by side (each has its own lab host), longest first; most of their
# time is spent waiting on boots, health checks and the arbiter's timers, not on the CPU.
jobs=${MOLECULE_JOBS:-3}
order="site arbiter recorder negative vllm_negative comfyui_negative vllm comfyui plex docker_engine xe_driver kernel_release"
all=$(for f in molecule/*/molecule.yml; do basename "$(dirname "$f")"; done)
if [ -n "${SCENARIOS:-}" ]; then
  scenarios=$SCENARIOS
else
  scenarios=$(for s in $order; do echo "$all" | grep -qx "$s" && echo "$s"; done
              for s in $all; do echo " $order " | grep -q " $s " || echo "$s"; done)
fi
logs=.cache/molecule-logs; rm -rf "$logs"; mkdir -p "$logs"
echo "molecule: $(wc -w <<<"$scenarios") scenarios, $jobs at a time; logs in $logs/"
# shellcheck disable=SC2016  # $1 and $(...) in the quoted script are expanded by the inner bash
for s in $scenarios; do echo "$s"; done | xargs -P "$jobs" -I{} bash -c '
  start=$(date +%s)
  if molecule test -s "$1" >"'"$logs"'/$1.log" 2>&1; then r=PASS; else r=FAIL; fi
  echo "$r $1 $(( $(date +%s) - start ))s" | tee -a "'"$logs"'/summary"
' _ {}
failed=$(awk '$1 == "FAIL" {print $2}' "$logs/summary")
for s in $failed; do
  echo; echo "==> molecule scenario $s failed; the end of its log:"
  sed 's/\x1b\[[0-9;]*m//g' "$logs/$s.log" | tail -n 200
done
passed=$(grep -c '^PASS' "$logs/summary" || true)
nfailed=$(grep -c '^FAIL' "$logs/summary" || true)
echo; echo "molecule: $passed passed, $nfailed failed"
if [ -n "$faults_pid" ]; then
  step "fault injection (its end)"
  if wait "$faults_pid"; then faults_rc=0; else faults_rc=$?; fi
  grep -E '^[0-9]+ (passed|failed)|passed|failed|jobs|duplicates' .cache/faults.log | tail -n 12
  if [ "$faults_rc" != 0 ]; then
    tail -n 150 .cache/faults.log
    fail "fault injection (pytest exit $faults_rc)"
  fi
fi
[ "$nfailed" = 0 ] || fail "molecule scenario(s): $failed"
echo; echo "make test: all passed"
