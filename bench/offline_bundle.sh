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
pins=$("$py" - <<'EOF'
import re
from importlib.metadata import PackageNotFoundError, distribution

# In any PyTorch image, and together far past what a 64 MiB transfer carries.
HEAVY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|numpy|scipy|matplotlib|contourpy|kiwisolver|fonttools|"
                   r"pillow|transformers|tokenizers|safetensors|huggingface-hub|hf-xet|sympy|mpmath|networkx|"
                   r"jinja2|markupsafe|fsspec|filelock|regex|setuptools)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


seen: dict[str, str] = {}
todo = [("resilientjob", {"local"})]
while todo:
    name, extras = todo.pop()
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        continue  # a requirement for another platform or Python, not installed here
    key = norm(dist.metadata["Name"])
    if key in seen or HEAVY.match(key):
        continue
    seen[key] = dist.version
    for requirement in dist.requires or []:
        spec, _, marker = requirement.partition(";")
        wanted = re.findall(r'extra\s*==\s*"([^"]+)"', marker)
        if wanted and not set(wanted) & extras:
            continue
        if "platform_python_implementation" in marker or "sys_platform == \"win32\"" in marker:
            continue
        match = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", spec)
        if match:
            todo.append((match[1], {e.strip() for e in (match[2] or "").split(",") if e.strip()}))
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
