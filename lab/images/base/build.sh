#!/bin/sh
# Builds the lab's base root filesystem with debootstrap and imports it as an image.
# usage: build.sh IMAGE_TAG
set -eu
tag=$1
here=$(dirname "$0")
pkgs=$(grep -v '^#' "$here/packages.txt" | paste -sd, -)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
debootstrap --variant=minbase --include="$pkgs" bookworm "$dir" http://deb.debian.org/debian >"$dir.log" 2>&1 \
  || { tail -n 20 "$dir.log" >&2; exit 1; }
rm -f "$dir.log"
# apt inside lab images reaches Debian the same way the machine does
rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
# Every lab image is built from this base and inherits its label, so the untagged build
# stages the lab's builds leave can be told from anyone else's (`images.sh --prune-stages`).
tar -C "$dir" -c . | docker import -c 'CMD ["/bin/bash"]' -c 'LABEL io.cardshare.lab=true' - "$tag" >/dev/null
