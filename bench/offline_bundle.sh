#!/usr/bin/env bash
# Packs what an offline host needs to run the local-stack benches (bench/failslow_demo_job.sh) when its
# Python already has PyTorch and the usual scientific stack but none of our control plane's packages, and
# it has no redis-server: a GPU machine that reaches no package index. On this (online) machine:
#
#   bash bench/offline_bundle.sh            # -> .dev/whl (wheels), .dev/bin/redis-server, .dev/lib
#   PYVER=3.12 DEST=.dev ...                # the target's Python (default 3.12) and where to write
#
# and on the target, from the repository root:
#
#   PATH=$PWD/.dev/bin:$PATH WHEELS=.dev/whl OUT=DIR bash bench/failslow_demo_job.sh
#
# The wheels are this package and every package it needs (with the `local` extra: the emulated API
# server), at the versions installed in .venv here, so the target runs what the tests ran; built for
# CPython $PYVER on manylinux x86-64. Left out are the large packages any PyTorch image has (torch and
# its CUDA libraries, numpy, scipy, matplotlib, the Hugging Face stack): a torch-less target would need
# `pip install` of those too. redis-server travels as the binary installed here with its shared libraries.
# A DEST inside the checkout is added to .git/info/exclude, so it is never committed (a tool that copies
# the working tree to the target must then be told to take it along).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${DEST:-.dev}
pyver=${PYVER:-3.12}
py=${PYTHON:-.venv/bin/python}
"$py" -c 'import resilientjob' || { echo "no resilientjob in $py: run 'make bootstrap' first" >&2; exit 1; }
command -v redis-server >/dev/null || { echo "no redis-server here: run 'make bootstrap' first" >&2; exit 1; }
rm -rf "$dest/whl" && mkdir -p "$dest/whl" "$dest/bin" "$dest/lib"  # one version of each wheel
if [[ $dest != /* ]]; then  # inside the checkout: never committed
    grep -qx "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >>.git/info/exclude
fi

# name==version of everything resilientjob[local] needs, from what is installed here.
pins=$("$py" - "$pyver" <<'EOF'
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

# In any PyTorch image, and together far past what a 64 MiB transfer carries.
HEAVY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|numpy|scipy|matplotlib|contourpy|kiwisolver|fonttools|"
                   r"pillow|transformers|tokenizers|safetensors|huggingface-hub|hf-xet|sympy|mpmath|networkx|"
                   r"jinja2|markupsafe|fsspec|filelock|regex|setuptools)$")
# The target's markers: CPython PYVER on Linux x86-64.
TARGET = {"python_version": sys.argv[1], "python_full_version": f"{sys.argv[1]}.0",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**TARGET, "extra": extra}) for extra in extras or {""})


seen: dict[str, str] = {}
walked: dict[str, set[str]] = {}  # the extras each package's requirements were read with
todo = [("resilientjob", {"local"})]
while todo:
    name, extras = todo.pop()
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        continue  # not installed here (the target does not need it, or this host's Python did not)
    key = norm(dist.metadata["Name"])
    if HEAVY.match(key) or (key in walked and extras <= walked[key]):
        continue
    seen[key] = dist.version
    walked[key] = walked.get(key, set()) | extras
    for text in dist.requires or []:
        requirement = Requirement(text)
        if wanted(requirement, extras):
            todo.append((requirement.name, set(requirement.extras)))
seen.pop("resilientjob")
print("\n".join(f"{name}=={version}" for name, version in sorted(seen.items())))
EOF
)

platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_34_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
# One pin at a time: a pin with no wheel for the target names itself instead of failing the lot.
for pin in $pins; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        "${platforms[@]}" -d "$dest/whl" "$pin" || { echo "no $pyver wheel of $pin" >&2; exit 1; }
done
# (setuptools warns at length that profiles/ and traces/ are data folders, which they are: kept in a log.)
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest/whl" . >"$dest/wheel.log" 2>&1 ||
    { cat "$dest/wheel.log" >&2; exit 1; }

# redis-server and the libraries it links, found by the loader here; a wrapper points the loader there.
cp "$(command -v redis-server)" "$dest/lib/redis-server"
ldd "$dest/lib/redis-server" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|ld-linux[^/]*)\.so' |
    xargs -r -I{} cp -L {} "$dest/lib/"
cat >"$dest/bin/redis-server" <<'EOF'
#!/bin/sh
here=$(cd "$(dirname "$0")/../lib" && pwd)
LD_LIBRARY_PATH="$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server" "$@"
EOF
chmod +x "$dest/bin/redis-server"
"$dest/bin/redis-server" --version >/dev/null

echo "$(ls "$dest/whl" | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest"
