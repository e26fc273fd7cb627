"""The wheels `make gpu-check` brings to a GPU machine that cannot reach a package registry.

    python3 bench/gpu_check/wheels.py download [--dest DIR] [--python-version 3.12] [--glibc 2.39]
    python3 bench/gpu_check/wheels.py install [--wheels DIR] [--target DIR]

``download`` (``make gpu-wheels``, on a machine with a registry) fetches the wheels listed in
wheels.txt for the GPU machine's Python and platform, whatever this machine runs. ``install``
(``make gpu-check``, on the GPU machine, under the python3 that will run the check) installs from
those files alone the ones that python3 lacks, into a folder put on PYTHONPATH: the machine's own
torch, and any package it already has, stay what is checked. NVRx is the exception: anything but
the version under test is shadowed by the carried one.

Run as a script, never imported by python3 before the install: standard library only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LIST = HERE / "wheels.txt"
DEFAULT_DIR = REPO / "build" / "gpu-wheels"
DEFAULT_TARGET = REPO / "build" / "gpu-site"
#: Installed even where the machine has another version: the version gpu-check is about.
UNDER_TEST = "nvidia-resiliency-ext"
#: Never carried: the machine's torch is what gpu-check checks, and CUDA wheels weigh GBs.
FORBIDDEN = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-(?!resiliency-ext$|ml-py$).*)$")
#: manylinux_2_5 is manylinux1, the oldest tag there is; 2_12 and 2_17 have legacy names too.
OLDEST_GLIBC_MINOR = 5
LEGACY_TAGS = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path = LIST) -> dict[str, str]:
    """wheels.txt as {normalized name: pinned version}; refuses a line that is not name==version
    or names torch, triton or a CUDA wheel."""
    pins = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"{path}:{number}: {raw!r} is not name==version")
        name = normalize(name.strip())
        if FORBIDDEN.match(name):
            raise SystemExit(f"{path}:{number}: {name} is never carried: the machine's own torch/CUDA is checked")
        pins[name] = version.strip()
    return pins


def platforms(glibc: str, arch: str) -> list[str]:
    """Every manylinux tag a machine with ``glibc`` accepts. Spelled out because pip (23.x at least)
    does not widen a --platform of manylinux_2_39 to the older manylinux tags most wheels carry."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < OLDEST_GLIBC_MINOR:
        raise SystemExit(f"--glibc {glibc}: expected 2.{OLDEST_GLIBC_MINOR} or newer")
    tags = []
    for m in range(minor, OLDEST_GLIBC_MINOR - 1, -1):
        tags.append(f"manylinux_2_{m}_{arch}")
        if m in LEGACY_TAGS:
            tags.append(f"{LEGACY_TAGS[m]}_{arch}")
    return tags


def download(dest: Path, python_version: str, glibc: str, arch: str) -> int:
    pins = read_list()
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # a changed pin must not leave two versions to choose from
        old.unlink()
    abi = "cp" + python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    command += ["--python-version", python_version, "--implementation", "cp", "--abi", abi]
    command += [arg for tag in platforms(glibc, arch) for arg in ("--platform", tag)]
    command += [f"{name}=={version}" for name, version in pins.items()]
    rc = subprocess.run(command).returncode
    if rc != 0:
        print(f"gpu-wheels: pip download failed (exit {rc})", file=sys.stderr)
        return rc
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(
        f"gpu-wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB, in {dest} for CPython {python_version} on "
        f"glibc {glibc} {arch}. Copy the repository with it to the GPU machine and run `make gpu-check` there."
    )
    return 0


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def to_install(pins: dict[str, str], installed: dict[str, str | None]) -> list[str]:
    """The requirements to install: the ones the machine lacks, and the version under test unless the
    machine has that very version. pip runs from its wheel and is never installed."""
    wanted = []
    for name, version in pins.items():
        have = installed.get(name)
        if name == "pip" or (have is not None and (name != UNDER_TEST or have == version)):
            continue
        wanted.append(f"{name}=={version}")
    return wanted


def install(wheels: Path, target: Path) -> int:
    pins = read_list()
    torch = installed_version("torch")
    if torch is None:
        print(f"gpu-check: {sys.executable} has no torch; it runs on the machine's own torch", file=sys.stderr)
        return 2
    installed = {name: installed_version(name) for name in pins}
    wanted = to_install(pins, installed)
    pip_wheel = next(iter(sorted(wheels.glob(f"pip-{pins['pip']}-*.whl"))), None)
    if wanted and pip_wheel is None:  # a machine that has it all (the training image) needs no wheels
        print(
            f"gpu-check: {sys.executable} lacks {', '.join(wanted)} and {wheels} has no wheels: run "
            "`make gpu-wheels` on a machine with a registry and bring that folder",
            file=sys.stderr,
        )
        return 2
    shutil.rmtree(target, ignore_errors=True)  # from the wheels alone, every time: nothing stale
    target.mkdir(parents=True)
    if wanted:
        command = [sys.executable, str(pip_wheel / "pip"), "install", "--no-index", "--find-links", str(wheels)]
        # --isolated: no pip configuration or PIP_* variable of the machine applies (an index, a
        # find-links folder); a root user on a GPU box is ordinary, so no warning about it.
        command += ["--no-deps", "--target", str(target), "--quiet", "--isolated", "--root-user-action=ignore"]
        command += ["--disable-pip-version-check", *wanted]
        rc = subprocess.run(command).returncode
        if rc != 0:
            print(f"gpu-check: installing {wanted} from {wheels} failed (exit {rc})", file=sys.stderr)
            return rc
    kept = [f"{name} {installed[name]}" for name in pins if name != "pip" and f"{name}=={pins[name]}" not in wanted]
    print(
        f"gpu-check: python {sys.version.split()[0]}, torch {torch} (the machine's); installed into {target}: "
        f"{', '.join(wanted) or 'nothing'}; the machine's own: {', '.join(kept) or 'none'}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 bench/gpu_check/wheels.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    down = sub.add_parser("download", help="download the wheels (a machine with a registry)")
    down.add_argument("--dest", type=Path, default=DEFAULT_DIR)
    down.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    down.add_argument("--glibc", default="2.39", help="the GPU machine's glibc (default 2.39: Ubuntu 24.04)")
    down.add_argument("--arch", default="x86_64")
    inst = sub.add_parser("install", help="install what this python3 lacks from the wheels (the GPU machine)")
    inst.add_argument("--wheels", type=Path, default=DEFAULT_DIR)
    inst.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    args = parser.parse_args(argv)
    if args.command == "download":
        return download(args.dest, args.python_version, args.glibc, args.arch)
    return install(args.wheels, args.target)


if __name__ == "__main__":
    sys.exit(main())
