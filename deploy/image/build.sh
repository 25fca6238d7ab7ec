#!/usr/bin/env bash
# Build the tensorbus image with buildah from a Debian bookworm base made by
# debootstrap: nothing is pulled from a container registry.
#
#   deploy/image/build.sh            tensorbus:<version>         (Containerfile, CPU)
#   deploy/image/build.sh --cuda     tensorbus:<version>-cuda12  (Containerfile.cuda)
#
# 1. The base: `debootstrap --variant=minbase` with python3 and python3-venv, kept as
#    a tarball under $TENSORBUS_IMAGE_CACHE (default /var/cache/tensorbus-image) and
#    imported once as localhost/tensorbus-base:<key>; the key is a hash of what the
#    base is made of, so a second run reuses both.
# 2. The image: `buildah bud --isolation chroot --layers`. The wheels downloaded from
#    PyPI stay in $TENSORBUS_IMAGE_CACHE/build/wheels (mounted into the build, never
#    into the image), and the layer of the dependencies is reused until
#    pyproject.toml changes. pip in the build trusts the certificate bundle named by
#    the host's PIP_CERT, if set.
#
# Needs root and Debian's `buildah` and `debootstrap` packages. Prints the tag and
# the image's id on stdout, each phase's time in seconds on stderr
# (`phase NAME SECONDS`).
set -euo pipefail
cd "$(dirname "$0")/../.."

variant=cpu
for arg in "$@"; do
    case "$arg" in
        --cuda) variant=cuda ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument $arg (use --cuda or nothing)" >&2; exit 2 ;;
    esac
done
for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || {
        echo "build.sh: $tool is missing: apt-get install --no-install-recommends buildah debootstrap" >&2
        exit 1
    }
done
[ "$(id -u)" -eq 0 ] || { echo "build.sh: run it as root (debootstrap and buildah's storage)" >&2; exit 1; }

cache="${TENSORBUS_IMAGE_CACHE:-/var/cache/tensorbus-image}"
mirror="${TENSORBUS_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=bookworm
packages=python3,python3-venv,libstdc++6
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
mkdir -p "$cache"

# A host that refuses the nproc ulimit buildah sets for each RUN step: point
# CONTAINERS_CONF at a file holding `[containers]` and `default_ulimits = []`.

# One build at a time on this machine: two would debootstrap into the same folder.
exec 9>"$cache/build.lock"
flock 9

phase() { echo "phase $1 $2" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# 1. The base.
key=$(printf '%s\n' "$suite" minbase "$packages" "$mirror" v1 | sha256sum | cut -c1-12)
base="localhost/tensorbus-base:$suite-$key"
tarball="$cache/base-$suite-$key.tar"
if [ ! -f "$tarball" ]; then
    t=$(now)
    root="$cache/rootfs-$key.tmp"
    rm -rf "$root"
    debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" \
        > "$cache/debootstrap.log" 2>&1 || {
        tail -20 "$cache/debootstrap.log" >&2; echo "build.sh: debootstrap failed" >&2; exit 1; }
    # What an image does not need: downloaded packages, package lists, documentation,
    # and the host's name and resolver (the runtime provides its own).
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
        "$root"/var/log/* "$root"/etc/hostname "$root"/etc/resolv.conf
    tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
    phase debootstrap "$(since "$t")"
else
    phase debootstrap 0.0
fi
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    t=$(now)
    ctr=$(buildah from --pull=never scratch)
    mnt=$(buildah mount "$ctr")
    tar --numeric-owner -C "$mnt" -xf "$tarball"
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd /bin/bash --label "org.opencontainers.image.base.name=debian:$suite-minbase" "$ctr"
    buildah commit --quiet --rm "$ctr" "$base" >/dev/null
    phase import-base "$(since "$t")"
else
    phase import-base 0.0
fi

# 2. The image.
if [ "$variant" = cuda ]; then
    file=deploy/image/Containerfile.cuda tag="tensorbus:$version-cuda12"
else
    file=deploy/image/Containerfile tag="tensorbus:$version"
fi
# The build's cache directory, mounted at /var/cache/build: the wheelhouse, and the
# certificate bundle the host's pip trusts (PIP_CERT: a proxy's CA, say), if any.
mkdir -p "$cache/build/wheels"
trust=()
if [ -n "${PIP_CERT:-}" ]; then
    cp "$PIP_CERT" "$cache/build/ca.pem"
    trust=(--build-arg PIP_CERT=/var/cache/build/ca.pem)
fi
t=$(now)
iid=$(mktemp)
trap 'rm -f "$iid"' EXIT
buildah bud --iidfile "$iid" --isolation chroot --layers --force-rm --pull=never --quiet \
    --build-arg "BASE=$base" --volume "$cache/build:/var/cache/build" \
    --build-arg BUILD_CACHE=/var/cache/build "${trust[@]}" \
    -f "$file" -t "$tag" . >/dev/null
phase bud "$(since "$t")"
# Earlier builds' images that no tag names any more (a replaced dependency layer is
# a gigabyte); the layers this build used stay, being the new image's. One still used
# by a container (a run killed before it removed its own) stays until the next build.
buildah rmi --prune >/dev/null 2>&1 || true
# The tag, then the image's id (another build may move the tag later).
echo "$tag $(sed "s/^sha256://" "$iid")"
