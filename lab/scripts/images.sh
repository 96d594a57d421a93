#!/usr/bin/env bash
# Builds the lab images that are missing, each tagged by the hash of its recipe, so a
# cached image is reused until its recipe changes (or the cache is gone).
#
#   images.sh [NAME...]     build (if missing) and tag cardshare-lab/NAME:current
#   images.sh --tag NAME    print the hashed tag of NAME
set -euo pipefail
cd "$(dirname "$0")/../.."

hash_of() { # hash of files under the given paths plus extra strings
  { for p in "$@"; do
      if [ -e "$p" ]; then find "$p" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum; else echo "$p"; fi
    done; } | sha256sum | cut -c1-12
}

recipe_hash() {
  case "$1" in
    base) hash_of lab/images/base ;;
    rhel10-sim) hash_of lab/images/rhel10-sim "base=$(recipe_hash base)" ;;
    *) echo "images.sh: unknown image '$1'" >&2; exit 2 ;;
  esac
}

tag_of() { echo "cardshare-lab/$1:$(recipe_hash "$1")"; }

have() { docker image inspect "$1" >/dev/null 2>&1; }

build() {
  local name=$1 tag
  tag=$(tag_of "$name")
  if have "$tag"; then
    echo "images: $tag cached"
  else
    echo "images: building $tag"
    case "$name" in
      base) lab/images/base/build.sh "$tag" ;;
      rhel10-sim)
        build base >/dev/null
        docker build -q --build-arg "BASE=$(tag_of base)" -t "$tag" lab/images/rhel10-sim >/dev/null ;;
    esac
  fi
  docker tag "$tag" "cardshare-lab/$name:current"
}

if [ "${1:-}" = "--tag" ]; then tag_of "$2"; exit 0; fi
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(base rhel10-sim)
for n in "${names[@]}"; do build "$n"; done
