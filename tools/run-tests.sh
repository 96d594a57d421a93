#!/usr/bin/env bash
# `make test`: everything, from a bare machine. Installs what is missing, starts a Docker
# engine of the project's own when none answers (and stops only that one at the end),
# builds the lab images it lacks (cached by recipe hash) and runs every molecule scenario,
# while the static checks run beside them: lint, unit tests, then the arbiter's fault
# injection. Exits non-zero when anything fails; prints how long each part took.
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
# shellcheck source=tools/project-env.sh
. tools/project-env.sh

static_pid=""
if [ -z "${SKIP_STATIC:-}" ]; then
  # Lint, the unit tests and the arbiter's fault injection (real processes on 127.0.0.1) use
  # one core at a time; the lab images and the scenarios mostly wait on builds, boots, health
  # checks and the arbiter's timers. So the static lane runs beside them, one step after the
  # other, and its result is read at the end (make lint, make unit, make faults run each alone).
  step "static checks (in the background; log in .cache/static.log)"
  mkdir -p .cache
  (
    lane_step() { echo; echo "==> $1 ($(date -u +%H:%M:%S))"; }
    lane_step lint; tools/lint.sh || { echo "static: FAILED at lint"; exit 1; }
    lane_step "unit tests"; pytest -q -p no:cacheprovider; rc=$?
    # pytest exits 5 when it collected nothing: that is a failure here, not a pass
    [ $rc = 0 ] || { echo "static: FAILED at unit tests (pytest exit $rc)"; exit 1; }
    lane_step "fault injection: the matrix"
    pytest -q -p no:cacheprovider tests/faults -m "faults and not faults_random" \
      || { echo "static: FAILED at fault injection (the matrix)"; exit 1; }
    lane_step "fault injection: the randomized run"
    FAULTS_RANDOM_SEED=${FAULTS_RANDOM_SEED:-20261201} \
      pytest -q -p no:cacheprovider -s tests/faults -m faults_random \
      || { echo "static: FAILED at fault injection (the randomized run)"; exit 1; }
    lane_step "static: all passed"
  ) >.cache/static.log 2>&1 &
  static_pid=$!
  static_start=$SECONDS
fi

step "lab engine"
# stop at the end only an engine this run started
if ! DOCKER_HOST=$(lab/scripts/engine.sh host) timeout 10 docker info >/dev/null 2>&1; then
  lab/scripts/engine.sh start || fail engine
  started_engine=1
fi
DOCKER_HOST=$(lab/scripts/engine.sh host); export DOCKER_HOST
echo "engine: DOCKER_HOST=$DOCKER_HOST"

images_start=$SECONDS
step "lab images"; lab/scripts/images.sh || fail images
images_seconds=$(( SECONDS - images_start ))

step "molecule"
export MOLECULE_GLOB='molecule/*/molecule.yml'
# each task timed in the logs, the slowest listed at the end of each play run
export ANSIBLE_CALLBACKS_ENABLED=${ANSIBLE_CALLBACKS_ENABLED:-ansible.posix.profile_tasks}
# Scenarios run side by side (each has its own lab host), longest first; most of their
# time is spent waiting on boots, health checks and the arbiter's timers, not on the CPU.
jobs=${MOLECULE_JOBS:-3}
order="site retrieval plex transcode_campaign arbiter fleet multicard recorder vllm comfyui card_path negative"
all=$(for f in molecule/*/molecule.yml; do basename "$(dirname "$f")"; done)
if [ -n "${SCENARIOS:-}" ]; then
  scenarios=$SCENARIOS
else
  scenarios=$(for s in $order; do echo "$all" | grep -qx "$s" && echo "$s"; done
              for s in $all; do echo " $order " | grep -q " $s " || echo "$s"; done)
fi
molecule_start=$SECONDS
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
molecule_seconds=$(( SECONDS - molecule_start ))
echo; echo "molecule: $passed passed, $nfailed failed in ${molecule_seconds}s"
echo "each scenario's total (in the order they ended), then where its time went (seconds a stage):"
cat "$logs/summary"
python tools/molecule_stages.py "$logs"/*.log || true
static_rc=0
if [ -n "$static_pid" ]; then
  step "static checks (their end)"
  if wait "$static_pid"; then static_rc=0; else static_rc=$?; fi
  echo "static: ended $(( SECONDS - static_start ))s after it started"
  grep -E '^==> |passed|failed|jobs|duplicates|^lint: |FAILED' .cache/static.log | tail -n 40
  [ "$static_rc" = 0 ] || tail -n 150 .cache/static.log
fi
echo; echo "times: lab images ${images_seconds}s, molecule ${molecule_seconds}s, all ${SECONDS}s"
[ "$static_rc" = 0 ] || fail "static checks (see above and .cache/static.log)"
[ "$nfailed" = 0 ] || fail "molecule scenario(s): $failed"
echo; echo "make test: all passed"
