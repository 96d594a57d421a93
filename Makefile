# cardshare.gpuhost: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help
# the project's own Docker CLI configuration (the compose plugin tools/venv.sh links), never ~/.docker
export DOCKER_CONFIG := $(CURDIR)/.cache/docker

.PHONY: help demo test lint unit faults conformance molecule deps venv collection-link engine engine-stop images lab-host lab-shell lab-down build clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | column -t -s $$'\t'

demo: ## build the lab if needed and run playbooks/site.yml against the lab host, twice
	tools/demo.sh

test: ## everything: lint, unit tests, every molecule scenario (installs and starts what it needs)
	tools/run-tests.sh

lint: venv ## yamllint, ansible-lint, ruff, mypy, role docs, changelog, ansible-test sanity, tarball
	tools/collection-link.sh && tools/lint.sh

unit: venv ## the Python unit tests
	tools/collection-link.sh && .venv/bin/pytest -q

faults: venv ## the arbiter's fault injection: the matrix, then the randomized 1,000-job run
	.venv/bin/pytest -q tests/faults -m "faults and not faults_random"
	.venv/bin/pytest -q -s tests/faults -m faults_random

conformance: ## real upstream vLLM on the CPU: the role's ladder, the arbiter's reading, the proxy (about 20 min; not in make test)
	tools/conformance.sh

molecule: ## every molecule scenario (SCENARIOS="a b" for some)
	SKIP_STATIC=1 tools/run-tests.sh

deps: ## install Docker engine and debootstrap (Debian, as root) when missing
	tools/deps.sh

venv: ## the pinned development virtualenv in .venv
	tools/venv.sh

collection-link: ## put the checkout on Ansible's collections path (.cache/collections) as cardshare.gpuhost
	tools/collection-link.sh

engine: ## start the project's Docker engine when none answers
	lab/scripts/engine.sh start

engine-stop: ## stop the project's Docker engine (only if the project started it)
	lab/scripts/engine.sh stop

images: ## build the lab images that are missing (cached by recipe hash)
	DOCKER_HOST=$$(lab/scripts/engine.sh host) lab/scripts/images.sh

lab-host: images ## create and boot the demo's lab host
	DOCKER_HOST=$$(lab/scripts/engine.sh host) lab/scripts/host.sh up

lab-shell: ## a shell on the demo's lab host, through the lab's Docker engine
	DOCKER_HOST=$$(lab/scripts/engine.sh host) docker exec -it $${CARDSHARE_LAB_HOST:-cardshare-lab-host} bash

lab-down: ## remove the demo's lab host and the untagged build stages the lab's image builds left
	DOCKER_HOST=$$(lab/scripts/engine.sh host) lab/scripts/host.sh down
	DOCKER_HOST=$$(lab/scripts/engine.sh host) lab/scripts/images.sh --prune-stages

build: venv ## build the collection tarball
	.venv/bin/ansible-galaxy collection build --force

clean: ## remove local caches (not the lab image cache)
	rm -rf .cache .pytest_cache .mypy_cache .ruff_cache cardshare-gpuhost-*.tar.gz
