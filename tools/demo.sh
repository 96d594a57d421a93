#!/usr/bin/env bash
# `make demo`: builds the lab if needed, boots the lab host, runs playbooks/site.yml
# against it (inventories/lab), runs it a second time to show nothing changes, and
# prints what was changed and proven.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
tools/venv.sh
tools/collection-link.sh
# shellcheck source=tools/project-env.sh
. tools/project-env.sh
if ! DOCKER_HOST=$(lab/scripts/engine.sh host) timeout 10 docker info >/dev/null 2>&1; then
  lab/scripts/engine.sh start
fi
DOCKER_HOST=$(lab/scripts/engine.sh host); export DOCKER_HOST
lab/scripts/images.sh
lab/scripts/host.sh up

logs=.cache/demo; mkdir -p "$logs"
echo; echo "==> the one step a user does by hand: download the models (SIMULATION: placeholders)"
ansible-playbook -i inventories/lab lab/playbooks/comfyui-models.yml >"$logs/models.log"
ansible-playbook -i inventories/lab lab/playbooks/vllm-weights.yml >>"$logs/models.log"
echo "==> ... and has a media library for the re-encode campaign (empty directories)"
ansible-playbook -i inventories/lab lab/playbooks/media-library.yml >>"$logs/models.log"
run_site() {
  ANSIBLE_STDOUT_CALLBACK=default ansible-playbook -i inventories/lab playbooks/site.yml --diff "$@"
}

h() { docker exec cardshare-lab-host "$@"; }
# shellcheck disable=SC2016  # $PRETTY_NAME is expanded by the lab host's shell
os_release() { h sh -c '. /etc/os-release && echo "$PRETTY_NAME"'; }
start_release="$(os_release); subscription $(h subscription-manager release --show)"

echo; echo "==> site.yml, first run"
run_site | tee "$logs/first.log"
# a value given the usual way, as a string on the command line, equal to the role's default
echo; echo "==> site.yml, second run with -e vllm_context_target=65536 (must change nothing)"
run_site -e vllm_context_target=65536 | tee "$logs/second.log"
recap=$(grep -E '^cardshare-lab-host +:' "$logs/second.log" | tail -n 1)
changed=$(echo "$recap" | sed -E 's/.*changed=([0-9]+).*/\1/')

echo; echo "==> what the box is now (read on the lab host)"
R=/srv/cardshare-sim
echo "release before:   $start_release"
echo "release now:      $(os_release); subscription $(h subscription-manager release --show)"
echo "kernels:          $(h rpm -q kernel-core | tr '\n' ' ')"
echo "running kernel:   $(h cat $R/proc/sys/kernel/osrelease) (SIMULATION: the lab's simulated boot)"
echo "card 0000:03:00.0 driver: $(basename "$(h readlink $R/sys/bus/pci/devices/0000:03:00.0/driver)"), $(h sh -c "grep -h status: $R/sys/kernel/debug/dri/0/gt*/uc/*_info | tr -s '\t\n' '  '")"
echo; echo "==> the box at work"
docker cp roles/arbiter/files/examples/flux_kontext_photo.json cardshare-lab-host:/var/tmp/cardshare-tour-workflow.json
docker exec -i cardshare-lab-host python3 - < lab/scripts/tour.py

echo
echo "second run: $recap"
if [ "$changed" != 0 ]; then
  echo "make demo: the second run changed $changed task(s); site.yml is not idempotent" >&2
  exit 1
fi
echo "make demo: the box works, and a second run changed nothing."
echo "The lab host stays up: 'make lab-shell' opens a shell on it, 'make lab-down' removes it."
echo "Docker commands in a new shell reach the lab's engine after:"
echo "  export DOCKER_HOST=$DOCKER_HOST"
