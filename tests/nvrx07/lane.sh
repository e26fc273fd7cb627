#!/usr/bin/env bash
# The NVRx 0.7 test lane runs the training tests (tests/training) on
# nvidia-resiliency-ext 0.7.0. That version does not install on this project's Debian 12 machines:
# its wheels are manylinux_2_39 and cp312/cp314 only, and the machines have glibc 2.36 and
# Python 3.11. So the lane runs the tests in a Debian testing root (Python 3.14, Debian's CPU torch),
# which setup-root.sh builds, inside a private mount and PID namespace.
#
#   bash tests/nvrx07/lane.sh [pytest args]      (make test-nvrx07; make test runs it too)
#   bash tests/nvrx07/lane.sh --bench MODULE [ARGS]   runs `python -m MODULE ARGS` in the root
#                                                    instead of pytest (make bench: the 0.7 part)
#
# - Needs root, zstd, and debootstrap (debootstrap only while no cached root exists). Where those
#   are missing, or NVRX07_LANE=skip, it prints one line and exits 0 (in CI, CI=true, it fails
#   instead, unless NVRX07_LANE=skip: .ci/run installs what it needs). With --bench it exits 3
#   there instead: no figures were written (bench.run reports the part skipped).
# - Everything lives outside the repo, in ${NVRX07_CACHE:-~/.cache/fsdp-resilience}:
#   - nvrx07-root-<hash>.tar.zst is the prepared root. <hash> is a hash of setup-root.sh, so
#     changing the recipe rebuilds it; a cold build takes a few minutes and needs the Debian
#     mirror and PyPI;
#   - nvrx07-root/ is the unpacked copy the runs use. It is kept between runs while its stamp
#     matches the hash.
# - Mounts (proc, sys, dev, dev/pts, a tmpfs on dev/shm, the repo at /repo) are made inside a
#   private mount namespace, so the host never sees them, and the PID namespace ends every process
#   the tests leave behind. Without unshare, the same mounts are made in the host's namespace, and
#   unmounted on exit.
# - Environment that belongs to this lane only, not to product code:
#   - USE_LIBUV=0, because Debian's torch is built without libuv;
#   - NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1, because local multi-node tests start several
#     ft_launchers on one host;
#   - TRAINING_TESTS_LANE=nvrx07, so tests marked one_lane (NVRx-independent: they would only
#     repeat the .venv lane's run on Debian's torch) are skipped here.
# shellcheck disable=SC2329  # unmount_all, end_leftovers and cleanup run from traps
set -euo pipefail

self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)/$(basename "${BASH_SOURCE[0]}")
here=$(dirname "$self")
recipe=$here/setup-root.sh
say() { printf 'nvrx07 lane: %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# Print the mount points at or under $1 in this mount namespace.
mounted_under() {
    awk -v d="$1" '{ m = $5; gsub(/\\040/, " ", m); if (m == d || index(m, d "/") == 1) print m }' \
        /proc/self/mountinfo
}

# Remove a directory, but never one that still has anything mounted under it: a bind mount of
# the repo or of /dev in there would be deleted through.
safe_rm() {
    local d=$1 m
    [ -e "$d" ] || return 0
    m=$(mounted_under "$d")
    if [ -n "$m" ]; then
        say "refusing to remove $d: still mounted there: $(echo "$m" | tr '\n' ' ')" >&2
        return 1
    fi
    rm -rf --one-file-system "$d"
}

# ---------------------------------------------------------------------------------------------
# Inside: pid 1 of a fresh mount + PID namespace (or a plain child, without unshare).
#   lane.sh __inside__ build ROOT MIRROR     debootstrap + the recipe's chroot phase
#   lane.sh __inside__ test ROOT REPO ARGS   the training tests
#   lane.sh __inside__ bench ROOT REPO MODULE ARGS   /opt/venv/bin/python -m MODULE ARGS (benchmarks)
MOUNTED=()
LANE_ROOT=
# Without a PID namespace, processes the tests left behind (a launcher in its own session, say)
# would outlive the run. End those whose root is the lane's root; the PID namespace does it
# otherwise.
end_leftovers() {
    local sig p pids
    [ -n "$LANE_ROOT" ] && [ $$ != 1 ] || return 0
    for sig in TERM KILL; do
        pids=()
        for p in /proc/[0-9]*; do
            if [ "$(readlink "$p/root" 2>/dev/null)" = "$LANE_ROOT" ]; then pids+=("${p#/proc/}"); fi
        done
        [ ${#pids[@]} -gt 0 ] || return 0
        kill "-$sig" "${pids[@]}" 2>/dev/null || true
        sleep 2
    done
}
unmount_all() {
    local i
    end_leftovers
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" || true
    done
    MOUNTED=()
}
# mnt ROOT WHERE MOUNT-ARGS...: mount at ROOT/WHERE and remember it for unmount_all.
mnt() {
    local at=$1$2
    shift 2
    mkdir -p "$at"
    mount "$@" "$at"
    MOUNTED+=("$at")
    # A bind of a shared mount would join its peer group; keep mounts below it from propagating.
    mount --make-private "$at"
}
mount_system() {
    local root=$1
    mnt "$root" /proc -t proc proc -o nosuid,nodev,noexec
    mnt "$root" /sys -t sysfs sysfs -o ro,nosuid,nodev,noexec
    mnt "$root" /dev --bind /dev                  # not --rbind: host mounts under /dev stay out
    mnt "$root" /dev/pts --bind /dev/pts
    mnt "$root" /dev/shm -t tmpfs shm -o "nosuid,nodev,mode=1777,size=${NVRX07_SHM_SIZE:-4g}"
}
inside() {
    local mode=$1 root=$2
    shift 2
    LANE_ROOT=$root
    trap unmount_all EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    case "$mode" in
    build)
        local mirror=$1
        bash "$recipe" host "$root" "$mirror"
        mount_system "$root"
        cp "$recipe" "$root/tmp/setup-root.sh"
        chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
            ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
            ${no_proxy:+no_proxy=$no_proxy} \
            bash /tmp/setup-root.sh chroot
        rm -f "$root/tmp/setup-root.sh"
        ;;
    test | bench)
        local repo=$1
        shift
        if [ "$mode" = bench ] && [ $# -eq 0 ]; then
            say "bench mode needs a module: lane.sh __inside__ bench ROOT REPO MODULE [ARGS]" >&2
            exit 2
        fi
        mount_system "$root"
        mnt "$root" /repo --bind "$repo"
        # Only this environment reaches the tests (env -i): nothing from the host's .venv (PATH,
        # VIRTUAL_ENV, PYTHONPATH) leaks in. The tests start subprocesses with sys.executable,
        # which is /opt/venv/bin/python.
        local env=(HOME=/root TMPDIR=/tmp/lane LANG=C.UTF-8 TERM="${TERM:-dumb}"
            PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
            VIRTUAL_ENV=/opt/venv
            PYTHONDONTWRITEBYTECODE=1                # no Python 3.14 bytecode left in the repo
            PYTHONPATH=/repo/src                     # the package, as `pip install -e .` gives the venvs
            USE_LIBUV=0 NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1 TRAINING_TESTS_LANE=nvrx07)
        if [ -n "${PYTEST_ADDOPTS:-}" ]; then env+=("PYTEST_ADDOPTS=$PYTEST_ADDOPTS"); fi
        # One line with what this lane runs, then the tests. With no paths in ARGS, pytest takes
        # testpaths (tests/training) from pyproject.toml.
        # (The versions come from package metadata: importing torch here would cost seconds.)
        local versions='import platform
from importlib.metadata import version
nvrx, torch = version("nvidia-resiliency-ext"), version("torch")
print(f"nvrx07 lane: nvidia-resiliency-ext {nvrx}, torch {torch}, Python {platform.python_version()}", flush=True)'
        # bench: the same root, mounts and environment, `python -m MODULE ARGS` instead of pytest.
        local run=(-m pytest -q -p no:cacheprovider)
        if [ "$mode" = bench ]; then run=(-m); fi
        # shellcheck disable=SC2016  # $1 and $@ expand in the inner bash
        chroot "$root" /usr/bin/env -i "${env[@]}" /bin/bash -c '
            set -e
            cd /repo
            /opt/venv/bin/python -c "$1"
            shift
            exec /opt/venv/bin/python "$@"
        ' nvrx07-lane "$versions" "${run[@]}" "$@"
        ;;
    *)
        say "unknown inside mode: $mode (build, test or bench)" >&2
        exit 2
        ;;
    esac
}

if [ "${1:-}" = __inside__ ]; then
    shift
    inside "$@"
    exit 0
fi

# `--bench MODULE [ARGS]`: run a benchmark module in the root instead of the tests.
lane_mode=test
if [ "${1:-}" = --bench ]; then
    shift
    if [ $# -eq 0 ] || [ -z "$1" ] || [ "${1#-}" != "$1" ]; then
        say "usage: lane.sh --bench MODULE [ARGS] (MODULE: a Python module, e.g. bench.training_plane)" >&2
        exit 2
    fi
    lane_mode=bench
fi

# ---------------------------------------------------------------------------------------------
# Outside: check what the machine has, get the root ready (unpacked, restored or built), run.
skip() {
    # CI installs what the lane needs (.ci/run): there a skip would hide that the lane never ran.
    if [ "${CI:-}" = true ] && [ "${NVRX07_LANE:-}" != skip ]; then
        say "cannot run in CI: $*" >&2
        exit 1
    fi
    say "skipped: $*"
    # A benchmark that could not run wrote no figures: exit 3 (bench.run reports the part skipped).
    if [ "$lane_mode" = bench ]; then exit 3; fi
    exit 0
}
[ "${NVRX07_LANE:-}" != skip ] || skip "NVRX07_LANE=skip"
[ "$(uname -s)" = Linux ] || skip "needs Linux (debootstrap, chroot, mounts)"
[ "$(id -u)" = 0 ] || skip "needs root (it debootstraps a Debian testing root, chroots into it and mounts in it)"

repo=$(cd "$here/../.." && pwd -P)
cache=${NVRX07_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fsdp-resilience}
missing=()
for tool in zstd tar chroot mount umount flock sha256sum; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
hash=$(sha256sum "$recipe" | cut -c1-16)
if [ ! -f "$cache/nvrx07-root-$hash.tar.zst" ] && ! command -v debootstrap >/dev/null; then
    missing+=(debootstrap)
fi
[ ${#missing[@]} -eq 0 ] || skip "missing ${missing[*]} (apt-get install debootstrap zstd)"

mkdir -p "$cache"
cache=$(cd "$cache" && pwd -P)
tarball=$cache/nvrx07-root-$hash.tar.zst
root=$cache/nvrx07-root
stamp=$root/.nvrx07-lane-stamp

# One lane at a time per cache: another run may be using the unpacked root.
exec 9>"$cache/nvrx07.lock"
if ! flock -n 9; then
    say "waiting for another run of the lane to finish"
    flock 9
fi

# A private mount + PID namespace when the kernel allows one; otherwise the host's namespace.
if unshare --mount --pid --fork --kill-child --propagation private true 2>/dev/null; then
    in_namespace() { unshare --mount --pid --fork --kill-child --propagation private bash "$self" __inside__ "$@"; }
else
    say "no private namespaces here (unshare failed): mounting in the host's namespace"
    in_namespace() { bash "$self" __inside__ "$@"; }
fi

work=
cleanup() {
    if [ -n "$work" ]; then safe_rm "$work" || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Leftovers of interrupted builds or restores.
for old in "$cache"/.nvrx07-work.*; do
    if [ -e "$old" ]; then safe_rm "$old"; fi
done

# Put a prepared root at $1 into place as the unpacked root.
install_root() {
    echo "$hash" >"$1/.nvrx07-lane-stamp"
    safe_rm "$root"
    mv "$1" "$root"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
    say "using the unpacked root $root ($hash)"
elif [ -f "$tarball" ]; then
    t0=$(now)
    work=$(mktemp -d "$cache/.nvrx07-work.XXXXXX")
    mkdir "$work/root"
    zstd -dcq "$tarball" | tar --numeric-owner -xpf - -C "$work/root"
    install_root "$work/root"
    say "restored the root from $tarball in $(since "$t0") s"
else
    mirror=${NVRX07_MIRROR:-}
    if [ -z "$mirror" ]; then
        mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
            | sed 's/#.*//' | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v -- '-security' | head -n1 \
            | sed 's/ *$//; s,/$,,') || true
        mirror=${mirror:-http://deb.debian.org/debian}
    fi
    say "building the root (Debian testing from $mirror, NVRx 0.7.0 from PyPI): a few minutes, once"
    t0=$(now)
    work=$(mktemp -d "$cache/.nvrx07-work.XXXXXX")
    if ! in_namespace build "$work/root" "$mirror"; then
        say "building the root failed (see above); nothing was cached" >&2
        exit 1
    fi
    t1=$(now)
    tar --numeric-owner -C "$work/root" -cf - . | zstd -q -T0 -3 -o "$work/root.tar.zst"
    mv "$work/root.tar.zst" "$tarball"   # same filesystem: atomic; an interrupted build caches nothing
    for other in "$cache"/nvrx07-root-*.tar.zst; do
        if [ "$other" != "$tarball" ]; then rm -f "$other"; fi
    done
    install_root "$work/root"
    say "built the root in $(since "$t0") s (packing it: $(since "$t1") s); cached as $tarball ($(du -h "$tarball" | cut -f1))"
fi

# Per run: fresh name resolution files and an empty TMPDIR.
cp /etc/resolv.conf /etc/hosts "$root/etc/"
safe_rm "$root/tmp/lane"
mkdir -p "$root/tmp/lane" "$root/repo"

rc=0
in_namespace "$lane_mode" "$root" "$repo" "$@" || rc=$?
if [ -n "$(mounted_under "$root")" ]; then
    say "warning: still mounted under $root: $(mounted_under "$root" | tr '\n' ' ')" >&2
fi
exit "$rc"
