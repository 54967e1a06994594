#!/bin/sh
# Puts Debian 13's containerd 1.7 (NRI v2) into a private directory for tests/nri, without touching the
# host's apt sources or packages: a trixie package list in a private apt dir, `apt-get download`, and
# `dpkg-deb -x`. The binaries link only against libc, so they run on Debian 12 (whose containerd, 1.6, has
# no NRI v2). About 10 MB of package lists and a 33 MB .deb; does nothing when the directory has it already.
#
#   scripts/get_containerd17.sh [DEST]        # DEST default /opt/containerd17 (tests read REAMER_CONTAINERD_DIR)
set -eu
dest=${1:-/opt/containerd17}
if [ -x "$dest/usr/bin/containerd" ]; then
  exit 0
fi
apt=$(mktemp -d)
trap 'rm -rf "$apt"' EXIT
mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/etc"
echo 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main' \
  > "$apt/etc/sources.list"
set -- -o Dir::Etc::SourceList="$apt/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null \
  -o Dir::State::Lists="$apt/lists" -o Dir::Cache="$apt/cache" -o APT::Sandbox::User=root
apt-get "$@" -qq update
(cd "$apt" && apt-get "$@" -qq download containerd)
mkdir -p "$dest.tmp"
dpkg-deb -x "$apt"/containerd_*.deb "$dest.tmp"
"$dest.tmp/usr/bin/containerd" --version
rm -rf "$dest" && mv "$dest.tmp" "$dest"
