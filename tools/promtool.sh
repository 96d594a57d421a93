#!/usr/bin/env bash
# Prints the path of a promtool for the alert rules' tests: PROMTOOL, else one on PATH, else
# the one of Debian's prometheus package, unpacked under .cache/promtool (apt-get download and
# dpkg-deb -x: no service installed, nothing of the system changed). Exits 1 without one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PROMTOOL:-}" ]; then echo "$PROMTOOL"; exit 0; fi
if command -v promtool >/dev/null 2>&1; then command -v promtool; exit 0; fi
dest=.cache/promtool/usr/bin/promtool
if [ -x "$dest" ]; then echo "$PWD/$dest"; exit 0; fi
command -v apt-get >/dev/null 2>&1 || { echo "promtool: none, and no apt-get to fetch Debian's" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fetch() { (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); }
fetch || { apt-get update -qq >/dev/null 2>&1 && fetch; } || {
  echo "promtool: apt-get download prometheus failed" >&2; exit 1; }
dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
mkdir -p "$(dirname "$dest")"
install -m 0755 "$tmp/x/usr/bin/promtool" "$dest"
echo "$PWD/$dest"
