#!/usr/bin/env bash
# The conformance matrix: `make conformance` for every supported vLLM release (or those named),
# one at a time. Usage: scripts/conformance-all.sh [RELEASE ...]   (make conformance-all)
#
# Per release: build its venv (scripts/vllm-venv.sh, through make), run the conformance tests,
# record the verdict, the build time and the test time, then remove the venv unless KEEP=1.
# A venv that was there before the run is never removed (only those this run built).
# Writes, outside the repository (OUT, default /tmp/kvspec-conformance):
#   OUT/summary.md      the table (release, verdict, test time, build time), also on stdout
#   OUT/X.log           each release's make output (the pytest report with its header)
# Verdicts: "conforms"; "finds #48102 (expected)" for a release with the bug whose tests pass
# (the machine found it); "FAILED: test names" otherwise; "BUILD FAILED" if its venv could
# not be built. Exit status: 0 when every release has the verdict conformance/releases.py
# expects of it, 1 otherwise.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-python3}
out=${OUT:-/tmp/kvspec-conformance}
keep=${KEEP:-0}
mkdir -p "$out"
if (($#)); then
    wanted=("$@")
else
    mapfile -t wanted < <("$py" "$root/conformance/releases.py" list)
fi
for v in "${wanted[@]}"; do   # every name checked before anything is built
    "$py" "$root/conformance/releases.py" check "$v" || exit 2
done

summary="$out/summary.md"
{
    echo "# make conformance, every release ($(date -u +%Y-%m-%dT%H:%MZ), $(git -C "$root" rev-parse --short HEAD))"
    echo
    echo "| release | verdict | tests (s) | build (s) |"
    echo "|---|---|---|---|"
} > "$summary"
cat "$summary"
status=0
for v in "${wanted[@]}"; do
    if [[ $v == 0.33.0 ]]; then venv="$root/.venv-vllm"; else venv="$root/.venv-vllm-$v"; fi
    existed=0; [[ -e $venv ]] && existed=1
    log="$out/$v.log"
    t0=$(date +%s)
    make -C "$root" --no-print-directory "$venv/.vllm-version" VLLM_VERSION="$v" PY="$py" > "$log" 2>&1
    built=$?
    t1=$(date +%s)
    if ((built != 0)); then
        verdict="BUILD FAILED (see $log)"
        rc=1
    else
        make -C "$root" --no-print-directory conformance VLLM_VERSION="$v" PY="$py" >> "$log" 2>&1
        rc=$?
        failed=$(grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/' \
                 | sed -E 's#^tests/conformance/##' | sort -u | paste -sd ' ' -)
        bug=$("$py" -c "import sys; sys.path.insert(0, '$root'); from conformance import releases; print(int(releases.find('$v').bug_48102))")
        if ((rc == 0)) && ((bug)); then
            verdict="finds #48102 (expected): test_machine.py::test_machine_finds_the_48102_stuck_request"
        elif ((rc == 0)); then
            verdict="conforms"
        else
            verdict="FAILED: ${failed:-see $log}"
        fi
    fi
    t2=$(date +%s)
    ((rc == 0)) || status=1
    if ((existed == 0)) && [[ $keep != 1 ]]; then
        rm -rf "$venv"
    fi
    row="| $v | $verdict | $((t2 - t1)) | $((t1 - t0)) |"
    echo "$row" >> "$summary"
    echo "$row"
done
echo
echo "summary: $summary (logs: $out/RELEASE.log)"
exit $status
