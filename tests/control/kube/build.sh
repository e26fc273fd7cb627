#!/usr/bin/env bash
# Build the Kubernetes control plane the EKS tests run against, from source modules, and cache it.
#
#   bash tests/control/kube/build.sh        prints the cache directory (the binaries are in bin/)
#
# - kube-apiserver, kube-controller-manager, kube-scheduler from the Go module k8s.io/kubernetes.
#   Its go.mod replaces every k8s.io/<staging> module with ./staging/..., which the module zip
#   does not hold, so a module of our own requires k8s.io/kubernetes and replaces each staging
#   module with its published k8s.io/<name> v0.Y.Z. One `go build` for the three, so they share
#   the compiled packages.
# - kwok (sigs.k8s.io/kwok) simulates nodes and pod lifecycles without kubelets.
# - Karpenter's NodeClaim and NodePool CRDs come from sigs.k8s.io/karpenter (downloaded only).
# - etcd and a kubectl of the same minor as the apiserver's range come from Debian forky's
#   packages (bookworm's etcd 3.4 is too old), downloaded with apt (signatures checked) and
#   unpacked, not installed.
# - Everything, Go's module and build caches included, lives in
#   ${KUBE_CACHE:-~/.cache/fsdp-resilience}/k8s-<hash of this script>/, so changing a version
#   here rebuilds it. A cold build prints how long it took.
# - Where Go or the module proxy is missing it prints one line and exits 3 (the tests skip);
#   with CI=true the harness turns that into a failure.
set -euo pipefail

KUBERNETES_VERSION=v1.37.2      # newest minor in EKS standard support (see tests/control/kube/README.md)
STAGING_VERSION=v0.37.2
KWOK_VERSION=v0.7.0
KARPENTER_VERSION=v1.14.1       # its CRDs (NodeClaim, NodePool), for the Karpenter replacement mode
DEBIAN_SUITE=forky              # etcd-server 3.5, kubectl 1.36

self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)/$(basename "${BASH_SOURCE[0]}")
hash=$(sha256sum "$self" | cut -c1-16)
cache=${KUBE_CACHE:-$HOME/.cache/fsdp-resilience}/k8s-$hash
say() { printf 'kube build: %s\n' "$*" >&2; }
# Run a step with its output in $cache/build.log, shown only when it fails.
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
    say "no Go toolchain on PATH: cannot build the Kubernetes control plane"
    exit 3
fi
mkdir -p "$cache"
exec 9>"$cache.lock"
flock 9
if [ -f "$cache/.complete" ]; then
    echo "$cache"
    exit 0
fi

export GOMODCACHE=$cache/gomod GOCACHE=$cache/gocache GOFLAGS=-mod=mod GOTOOLCHAIN=local
export CGO_ENABLED=0
start=$(date +%s)
if ! go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" >/dev/null 2>"$cache/proxy.err"; then
    say "the Go module proxy did not serve k8s.io/kubernetes@$KUBERNETES_VERSION: $(tail -1 "$cache/proxy.err")"
    exit 3
fi

# 1. The control plane.
mod=$cache/src/kubernetes
rm -rf "$mod" && mkdir -p "$mod" "$cache/bin"
cd "$mod"
go mod init fsdp-resilience.test/kube-control-plane >/dev/null 2>&1
gomod=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
args=(-require="k8s.io/kubernetes@$KUBERNETES_VERSION")
while read -r name; do
    args+=(-replace="$name=$name@$STAGING_VERSION")
done < <(awk '$2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }' "$gomod")
go mod edit "${args[@]}"
cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
GO
go mod tidy -e >/dev/null 2>&1 || true
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)"
say "building kube-apiserver, kube-controller-manager, kube-scheduler $KUBERNETES_VERSION (cold: many minutes on 2 cores)"
quiet go build -trimpath -ldflags="$ldflags" -o "$cache/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler
t_kube=$(( $(date +%s) - start ))

# 2. kwok (its stages are tests/control/kube/stages.yaml: pods run until a test ends them).
GOBIN=$cache/bin quiet go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
t_kwok=$(( $(date +%s) - start - t_kube ))

# 3. etcd and kubectl from Debian forky, through apt (so the archive's signatures are checked).
apt_dir=$cache/apt
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$cache/debs"
mirror=$(sed -n 's/^URIs: *//p; s/^deb \(http[^ ]*\) .*/\1/p' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v security | head -1) || true
mirror=${mirror:-http://deb.debian.org/debian}
cat > "$apt_dir/sources.list" <<SRC
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $DEBIAN_SUITE main
SRC
apt_opts=(-o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache::Archives="$apt_dir/archives"
          -o Dir::State::Status=/dev/null -o APT::Architecture=amd64 -o Debug::NoLocking=1)
quiet apt-get "${apt_opts[@]}" update -qq
(cd "$cache/debs" && quiet apt-get "${apt_opts[@]}" download etcd-server kubectl)
for deb in "$cache"/debs/*.deb; do dpkg -x "$deb" "$cache/debroot"; done
ln -sf "$cache/debroot/usr/bin/etcd" "$cache/bin/etcd"
ln -sf "$cache/debroot/usr/bin/kubectl" "$cache/bin/kubectl"

# 4. Karpenter's CRDs, from its module (the module is only downloaded, not built).
karpenter=$(cd / && go mod download -json "sigs.k8s.io/karpenter@$KARPENTER_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
mkdir -p "$cache/karpenter-crds"
cp "$karpenter"/pkg/apis/crds/karpenter.sh_*.yaml "$cache/karpenter-crds/"

# Go's module cache is read-only by default; let rm -rf clean the cache.
chmod -R u+w "$GOMODCACHE" 2>/dev/null || true
"$cache/bin/kube-apiserver" --version >&2
"$cache/bin/etcd" --version | head -1 >&2
total=$(( $(date +%s) - start ))
printf '{"kubernetes": "%s", "kwok": "%s", "karpenter_crds": "'"$KARPENTER_VERSION"'", "build_seconds": {"control_plane": %d, "kwok": %d, "total": %d}}\n' \
    "$KUBERNETES_VERSION" "$KWOK_VERSION" "$t_kube" "$t_kwok" "$total" > "$cache/build.json"
say "cold build done in ${total}s (control plane ${t_kube}s, kwok ${t_kwok}s): $cache"
touch "$cache/.complete"
echo "$cache"
