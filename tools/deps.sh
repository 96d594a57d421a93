#!/usr/bin/env bash
# Installs what the lab and the tests need on a bare Debian/Ubuntu machine (as root):
# the Docker engine and client (docker.io), debootstrap, busybox, ffmpeg and Chromium.
# Skips what is present.
set -euo pipefail
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
# the retrieval tier's seed script runs in busybox sh, as in the model image
command -v busybox >/dev/null 2>&1 || missing+=(busybox)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
# the re-encode campaign's tests: Debian's ffmpeg and ffprobe
command -v ffmpeg >/dev/null 2>&1 || missing+=(ffmpeg)
# the status page's browser test: Debian's Chromium, with a font to render text in
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-liberation)
[ ${#missing[@]} -gt 0 ] || exit 0
if [ "$(id -u)" != 0 ]; then
  echo "deps: missing ${missing[*]}; install them as root (apt-get install ${missing[*]})" >&2
  exit 1
fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
