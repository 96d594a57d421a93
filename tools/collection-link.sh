#!/usr/bin/env bash
# Puts the checkout on Ansible's collections path as cardshare.gpuhost.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache/collections/ansible_collections/cardshare
ln -sfn "$PWD" .cache/collections/ansible_collections/cardshare/gpuhost
