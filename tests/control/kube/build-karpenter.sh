#!/usr/bin/env bash
# Build Karpenter (its kwok cloud provider, sigs.k8s.io/karpenter/kwok) for the EKS tests of the
# Karpenter replacement mode, and cache it. A script of its own: build.sh's hash keys the
# control plane's cache, which this must not invalidate.
#
#   bash tests/control/kube/build-karpenter.sh     prints the cache directory (bin/karpenter, crds/)
#
# - The kwok cloud provider is Karpenter's real controllers (provisioning, disruption, NodeClaim
#   lifecycle, termination) with a cloud that creates a Node object per NodeClaim, annotated
#   kwok.x-k8s.io/node=fake, which the control plane's kwok then runs. The binary is named kwok
#   upstream; here it is bin/karpenter.
# - Karpenter v1.15 needs Go >= 1.26.10: GOTOOLCHAIN makes the go command on PATH fetch that
#   toolchain through the module proxy (into this cache's module cache).
# - The CRDs of the same version: karpenter.sh NodePool, NodeClaim, NodeOverlay (the kwok chart's,
#   which restrict the karpenter.kwok.sh label domain), autoscaling.x-k8s.io CapacityBuffer and
#   karpenter.kwok.sh KWOKNodeClass.
# - Everything, Go's module and build caches included, lives in
#   ${KUBE_CACHE:-~/.cache/fsdp-resilience}/karpenter-<hash of this script>/. A cold build prints
#   how long it took (about 5-6 minutes on 2 cores).
# - Where Go or the module proxy is missing it prints one line and exits 3 (the tests skip);
#   with CI=true the harness turns that into a failure.
set -euo pipefail

KARPENTER_VERSION=v1.15.0
GO_TOOLCHAIN=go1.27.3

self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)/$(basename "${BASH_SOURCE[0]}")
hash=$(sha256sum "$self" | cut -c1-16)
cache=${KUBE_CACHE:-$HOME/.cache/fsdp-resilience}/karpenter-$hash
say() { printf 'karpenter build: %s\n' "$*" >&2; }
quiet() {
    if ! "$@" >>"$cache/build.log" 2>&1; then
        say "failed: $*"; tail -30 "$cache/build.log" >&2; exit 1
    fi
}

if [ -f "$cache/.complete" ]; then
    echo "$cache"
    exit 0
fi
if ! command -v go >/dev/null; then
    say "no Go toolchain on PATH: cannot build Karpenter"
    exit 3
fi
mkdir -p "$cache"
exec 9>"$cache.lock"
flock 9
if [ -f "$cache/.complete" ]; then
    echo "$cache"
    exit 0
fi

export GOMODCACHE=$cache/gomod GOCACHE=$cache/gocache GOFLAGS=-mod=mod GOTOOLCHAIN=$GO_TOOLCHAIN
start=$(date +%s)
if ! go version >/dev/null 2>"$cache/proxy.err"; then
    say "the Go module proxy did not serve the $GO_TOOLCHAIN toolchain Karpenter $KARPENTER_VERSION needs: $(tail -1 "$cache/proxy.err")"
    exit 3
fi
if ! go mod download -json "sigs.k8s.io/karpenter@$KARPENTER_VERSION" >"$cache/module.json" 2>"$cache/proxy.err"; then
    say "the Go module proxy did not serve sigs.k8s.io/karpenter@$KARPENTER_VERSION: $(tail -1 "$cache/proxy.err")"
    exit 3
fi

# 1. The controller: `go install module@version` builds with Karpenter's own go.mod.
mkdir -p "$cache/bin"
say "building Karpenter $KARPENTER_VERSION (kwok cloud provider) with $GO_TOOLCHAIN (cold: about 5-6 minutes on 2 cores)"
GOBIN=$cache/bin quiet go install -trimpath -ldflags="-s -w" "sigs.k8s.io/karpenter/kwok@$KARPENTER_VERSION"
mv "$cache/bin/kwok" "$cache/bin/karpenter"

# 2. Its CRDs.
src=$(sed -n 's/.*"Dir": "\(.*\)",/\1/p' "$cache/module.json")
mkdir -p "$cache/crds"
cp "$src"/kwok/charts/crds/*.yaml "$src"/kwok/apis/crds/*.yaml "$cache/crds/"

# Go's module cache is read-only by default; let rm -rf clean the cache.
chmod -R u+w "$GOMODCACHE" 2>/dev/null || true
total=$(( $(date +%s) - start ))
printf '{"karpenter": "%s", "go": "%s", "build_seconds": %d}\n' "$KARPENTER_VERSION" "$GO_TOOLCHAIN" "$total" \
    > "$cache/build.json"
say "cold build done in ${total}s: $cache"
touch "$cache/.complete"
echo "$cache"
