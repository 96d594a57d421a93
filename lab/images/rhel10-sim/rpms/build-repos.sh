#!/bin/sh
# SIMULATION: builds the lab's local package repositories from kernels.txt with real
# rpmbuild and createrepo_c. Each stand-in kernel carries only what the roles read:
# /lib/modules/<uname -r>/modules.alias (xe and i915 lines) and a placeholder vmlinuz.
# Each RHEL minor release's repository also gets its redhat-release package (os-release,
# redhat-release), so a system update within a pinned release moves what the host reports.
set -eu
here=$(dirname "$0")
out=${1:-/srv/repos}
top=$(mktemp -d)
grep -v '^#' "$here/kernels.txt" | while IFS= read -r line; do
  [ -n "$line" ] || continue
  repo=$(echo "$line" | awk '{print $1}')
  name=$(echo "$line" | awk '{print $2}')
  ver=$(echo "$line" | awk '{print $3}')
  rel=$(echo "$line" | awk '{print $4}')
  vendor=$(echo "$line" | cut -d'|' -f1 | awk '{for (i=5;i<=NF;i++) printf "%s%s", $i, (i<NF?" ":"")}')
  ids=$(echo "$line" | cut -d'|' -f2 | tr -d ' ')
  kver="$ver-$rel.x86_64"
  src="$top/$name-$kver"
  mkdir -p "$src"
  {
    echo "# Aliases extracted from modules themselves."
    echo "# SIMULATION: cardshare lab stand-in kernel $kver"
    for id in $(echo "$ids" | tr ',' ' '); do
      echo "alias pci:v00008086d0000${id}sv*sd*bc03sc*i* xe"
    done
    # a few DG2 ids (the Arc A380's 56A5 among them): xe lists them too, as 6.12's xe_pci.c
    # does, but drives them only when force-probed (the lab's boot); i915 takes them otherwise
    for id in 56A0 56A1 56A5 56A6; do
      echo "alias pci:v00008086d0000${id}sv*sd*bc03sc*i* xe"
    done
    for id in 56A0 56A1 56A5 56A6; do
      echo "alias pci:v00008086d0000${id}sv*sd*bc03sc*i* i915"
    done
  } > "$src/modules.alias"
  cat > "$top/$name-$kver.spec" <<SPEC
Name: $name
Version: $ver
Release: $rel
Summary: SIMULATION: stand-in kernel $kver for the cardshare lab
License: GPL-2.0-only
Vendor: $vendor
BuildArch: x86_64
AutoReqProv: no
Provides: installonlypkg(kernel)

%description
SIMULATION. Carries no kernel, only the module alias table that the cardshare roles read.

%install
mkdir -p %{buildroot}/lib/modules/$kver/kernel/drivers/gpu/drm/xe
cp $src/modules.alias %{buildroot}/lib/modules/$kver/modules.alias
echo "SIMULATION: not a kernel" > %{buildroot}/lib/modules/$kver/vmlinuz

%files
/lib/modules/$kver
SPEC
  rpmbuild --quiet --define "_topdir $top/build" --define "_build_id_links none" \
    -bb "$top/$name-$kver.spec"
  mkdir -p "$out/$repo"
  cp "$top"/build/RPMS/*/"$name-$ver-$rel".*.rpm "$out/$repo/"
done
# redhat-release X.Y for each rhel/X.Y repository, as RHEL's own package lays the files out
grep -v '^#' "$here/kernels.txt" | awk '$1 ~ /^rhel\// {print $1}' | sort -u | while IFS= read -r repo; do
  minor=$(echo "$repo" | cut -d/ -f2)
  src="$top/redhat-release-$minor"
  mkdir -p "$src"
  cat > "$src/os-release" <<OSR
NAME="Red Hat Enterprise Linux"
VERSION="$minor (Coughlan)"
ID="rhel"
ID_LIKE="centos fedora"
VERSION_ID="$minor"
PLATFORM_ID="platform:el10"
PRETTY_NAME="Red Hat Enterprise Linux $minor (Coughlan)"
ANSI_COLOR="0;31"
HOME_URL="https://www.redhat.com/"
# SIMULATION: this is the cardshare lab host (Debian userland, real dnf/rpm/systemd/Docker),
# dressed as RHEL $minor by the lab's redhat-release package.
CARDSHARE_LAB_SIMULATION="1"
OSR
  echo "Red Hat Enterprise Linux release $minor (Coughlan)" > "$src/redhat-release"
  cat > "$top/redhat-release-$minor.spec" <<SPEC
Name: redhat-release
Version: $minor
Release: 1.el10
Summary: SIMULATION: the RHEL $minor release files for the cardshare lab
License: GPL-2.0-or-later
Vendor: Red Hat, Inc.
BuildArch: noarch
AutoReqProv: no
Provides: system-release = $minor

%description
SIMULATION. /etc/os-release and /etc/redhat-release of RHEL $minor, nothing else.

%install
mkdir -p %{buildroot}/usr/lib %{buildroot}/etc
cp $src/os-release %{buildroot}/usr/lib/os-release
ln -s ../usr/lib/os-release %{buildroot}/etc/os-release
cp $src/redhat-release %{buildroot}/etc/redhat-release
ln -s redhat-release %{buildroot}/etc/system-release

%files
/usr/lib/os-release
/etc/os-release
/etc/redhat-release
/etc/system-release
SPEC
  rpmbuild --quiet --define "_topdir $top/build" --define "_build_id_links none" \
    -bb "$top/redhat-release-$minor.spec"
  cp "$top/build/RPMS/noarch/redhat-release-$minor-1.el10.noarch.rpm" "$out/$repo/"
done
grep -v '^#' "$here/kernels.txt" | awk 'NF {print $1}' | sort -u | while IFS= read -r repo; do
  createrepo_c --quiet "$out/$repo"
done
rm -rf "$top"
