#!/usr/bin/env bash
# Build a virtual environment holding one pinned vLLM release and this project, for the
# conformance tests (make conformance). Usage: scripts/vllm-venv.sh VENV_DIR VLLM_VERSION
#
# Only vLLM's scheduler side is exercised, which is pure Python and runs on a CPU. So:
#   1. torch==2.13.0 first (the CPU build; vLLM's own torch pin does not matter here and must
#      never pull a multi-GB CUDA build);
#   2. the vLLM wheel itself with --no-deps;
#   3. the packages its scheduler-side imports need;
#   4. xgrammar and apache-tvm-ffi with --no-deps (with their deps, triton, ~1 GB, comes along);
#   5. this project (editable) with the dependencies pyproject.toml names.
set -euo pipefail
venv=${1:?usage: vllm-venv.sh VENV_DIR VLLM_VERSION}
version=${2:?usage: vllm-venv.sh VENV_DIR VLLM_VERSION}
py=${PY:-python3}
start=$(date +%s)
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "torch==2.13.0"
"${pip[@]}" install -q --no-deps "vllm==$version"
"${pip[@]}" install -q packaging psutil pyzmq urllib3 regex numpy transformers cbor2 aiohttp \
    requests openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop \
    py-cpuinfo prometheus-client fastapi partial-json-parser llguidance einops
"${pip[@]}" install -q --no-deps xgrammar apache-tvm-ffi
"${pip[@]}" install -q -e ".[test]"   # the dependencies pyproject.toml names; torch is already there
"$venv/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
echo "$version" > "$venv/.vllm-version"
echo "built $venv (vLLM $version) in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
