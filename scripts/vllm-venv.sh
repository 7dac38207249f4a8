#!/usr/bin/env bash
# Build a virtual environment holding one pinned vLLM release and this project, for the
# conformance tests (make conformance). Usage: scripts/vllm-venv.sh VENV_DIR VLLM_VERSION
#
# Only vLLM's scheduler side is exercised, which is pure Python and runs on a CPU. So:
#   1. torch==2.13.0 first (the CPU build; vLLM's own torch pin does not matter here and must
#      never pull a multi-GB CUDA build);
#   2. the vLLM wheel itself with --no-deps;
#   3. the packages its scheduler-side imports need: a common list, then the release's own
#      extras (conformance/releases.py, e.g. gguf for 0.22.x), each bounded as vLLM's own
#      requirements bound it (`releases.py pins`: the index's newest transformers is
#      outside vLLM 0.33.0's range and pulls in a `kernels` package this project's shadows);
#   4. xgrammar and apache-tvm-ffi with --no-deps (with their deps, triton, ~1 GB, comes along);
#   5. this project (editable) with the dependencies pyproject.toml names;
#   6. a check: every scheduler-side module the conformance code imports, imported.
# The release must be one conformance/releases.py lists (checked before anything is built).
# A venv that already holds this release is updated in place (the steps are no-ops where
# satisfied), not rebuilt: editing this script or the extras costs seconds, not a rebuild.
set -euo pipefail
venv=${1:?usage: vllm-venv.sh VENV_DIR VLLM_VERSION}
version=${2:?usage: vllm-venv.sh VENV_DIR VLLM_VERSION}
py=${PY:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
"$py" "$here/conformance/releases.py" check "$version"
mapfile -t extras < <("$py" "$here/conformance/releases.py" extras "$version")
start=$(date +%s)
have=$(cat "$venv/.vllm-release" 2>/dev/null || cat "$venv/.vllm-version" 2>/dev/null || true)
if [[ -x "$venv/bin/python" && "$have" == "$version" ]]; then
    echo "updating $venv (vLLM $version) in place"
    rm -f "$venv/.vllm-version"
    echo "$version" > "$venv/.vllm-release"
else
    rm -rf "$venv"
    "$py" -m venv "$venv"
    echo "$version" > "$venv/.vllm-release"   # what the venv holds (the stamp comes last)
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "torch==2.13.0"
"${pip[@]}" install -q --no-deps "vllm==$version"
"${pip[@]}" install -q packaging
# each package at the versions vLLM itself declares (it came with --no-deps)
pins() { "$venv/bin/python" "$here/conformance/releases.py" pins "$@"; }
mapfile -t common < <(pins psutil pyzmq urllib3 regex numpy transformers cbor2 aiohttp \
    requests openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop \
    py-cpuinfo prometheus-client fastapi partial-json-parser llguidance einops)
"${pip[@]}" install -q "${common[@]}"
if ((${#extras[@]})); then
    echo "extras for vLLM $version: ${extras[*]}"
    mapfile -t extras < <(pins "${extras[@]}")
    "${pip[@]}" install -q "${extras[@]}"
fi
# the newest of both, not vLLM's pins: 0.25.1 pins apache-tvm-ffi 0.1.9, which the xgrammar
# its range admits (0.2.9) cannot load
"${pip[@]}" install -q --no-deps xgrammar apache-tvm-ffi
"${pip[@]}" install -q -e "$here[test]"   # the dependencies pyproject.toml names; torch is already there
# Hugging Face's `kernels` (a requirement of transformers from 5.21) has the import name of
# this project's kernels/, which shadows it: transformers then fails importing it. vLLM's
# scheduler side never uses it, and transformers imports it only where it is installed.
"${pip[@]}" uninstall -q -y kernels 2>/dev/null || true
(cd "$here" && "$venv/bin/python" -c "
import sys, vllm
from conformance import vllm_env
vllm_env.scheduler_side_modules()
print('vllm', vllm.__version__, 'in', sys.prefix, '(scheduler-side imports: ok)')")
echo "$version" > "$venv/.vllm-version"
echo "built $venv (vLLM $version) in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
