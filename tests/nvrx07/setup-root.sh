#!/usr/bin/env bash
# The recipe for the NVRx 0.7 test lane's root. tests/nvrx07/lane.sh runs it, and caches the result
# under a hash of this file, so any change here causes a rebuild. Two phases:
#   setup-root.sh host ROOT MIRROR   on the host: debootstrap Debian testing into ROOT and configure it
#   setup-root.sh chroot             inside ROOT (with proc, sys and dev mounted): Python 3.14, Debian's
#                                    CPU torch, and nvidia-resiliency-ext 0.7.0 in /opt/venv
# nvidia-resiliency-ext 0.7.0 ships only cp312/cp314 manylinux_2_39 wheels. Debian testing has
# Python 3.14, a new enough glibc and a CPU torch for 3.14 (python3-torch).
set -euo pipefail

SUITE=forky
NVRX_VERSION=0.7.0
# What the tests need besides NVRx (pytest, and imports of their own). The torch and numpy come
# from Debian.
EXTRA=(pytest numpy pyyaml psutil crc32c)

case "${1:-}" in
host)
    root=$2 mirror=$3
    # bookworm's debootstrap has no script for forky. sid's script works, and it checks the
    # signatures with bookworm's keyring.
    debootstrap --variant=minbase "$SUITE" "$root" "$mirror" /usr/share/debootstrap/scripts/sid
    # The mirror can serve a dated snapshot whose Release is past its Valid-Until.
    printf 'Acquire::Check-Valid-Until "false";\nAcquire::Check-Date "false";\n' \
        >"$root/etc/apt/apt.conf.d/99nvrx07-lane"
    # Copy in the extra CA certificates this machine trusts (e.g. a TLS-inspecting egress proxy):
    # pip needs them. update-ca-certificates picks them up inside.
    mkdir -p "$root/usr/local/share/ca-certificates"
    for crt in /usr/local/share/ca-certificates/*.crt; do
        if [ -e "$crt" ]; then cp "$crt" "$root/usr/local/share/ca-certificates/"; fi
    done
    cp /etc/resolv.conf /etc/hosts "$root/etc/"   # lane.sh copies them in again at every run
    ;;
chroot)
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends python3-venv python3-torch ca-certificates
    update-ca-certificates
    python3 -m venv --system-site-packages /opt/venv

    # pip must never replace Debian's torch (a PyPI torch is a multi-GB CUDA build). Pin torch, and
    # numpy (torch is built against it), to the system's versions, do a dry run, and refuse if it
    # would install either of them (or any nvidia-* CUDA library).
    python3 - >/opt/venv/lane-constraints.txt <<'EOF'
from importlib.metadata import PackageNotFoundError, version
for name in ("torch", "numpy"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        if name == "torch":
            raise SystemExit("python3-torch has no package metadata: pip could not see it")
EOF
    pip=(/opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check --progress-bar off
         -c /opt/venv/lane-constraints.txt "nvidia-resiliency-ext==$NVRX_VERSION" "${EXTRA[@]}")
    "${pip[@]}" --dry-run --quiet --report /tmp/pip-dry-run.json
    /opt/venv/bin/python - <<'EOF'
import json
names = [i["metadata"]["name"].lower() for i in json.load(open("/tmp/pip-dry-run.json"))["install"]]
bad = [n for n in names if n in ("torch", "numpy") or n.startswith(("nvidia-cu", "nvidia-nccl", "triton"))]
if bad:
    raise SystemExit(f"pip would install {bad} over Debian's torch: refusing")
print("pip will install:", " ".join(sorted(names)))
EOF
    rm -f /tmp/pip-dry-run.json
    "${pip[@]}" --quiet

    # Check the result: NVRx 0.7.0 in the venv, on Debian's torch.
    /opt/venv/bin/python - <<EOF
from importlib.metadata import version
import torch
assert version("nvidia-resiliency-ext") == "$NVRX_VERSION", version("nvidia-resiliency-ext")
assert torch.__file__.startswith("/usr/lib/python3/"), f"torch is not Debian's: {torch.__file__}"
from nvidia_resiliency_ext import inprocess  # noqa: F401
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # noqa: F401
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue  # noqa: F401
EOF
    test -x /opt/venv/bin/ft_launcher
    /opt/venv/bin/pip freeze --all >/opt/venv/lane-freeze.txt   # what was resolved, for diagnosis

    apt-get clean
    rm -rf /var/lib/apt/lists/* /root/.cache
    ;;
*)
    echo "usage: $0 host ROOT MIRROR | chroot" >&2
    exit 2
    ;;
esac
