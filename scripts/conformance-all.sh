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
#   OUT/X.findings.txt  each failed test of release X with the first error it reports (the
#                       shrunk trace of a machine test), also appended to summary.md
#   OUT/X.soak.log      with SOAK_STEPS=N: release X's `make conformance-soak` output
# Verdicts: "conforms"; "finds #48102 (expected)" for a release with the bug whose machine
# found it (its test passed); "#48102 NOT FOUND" if that test failed; then "FAILED: test
# names" for every failed test; "BUILD FAILED" if its venv could not be built.
# With SOAK_STEPS=N (SOAK_SEED=S, default 0), each release is also soaked
# (`make conformance-soak VLLM_STEPS=N SEED=S`) and the table gains a column: each machine's
# steps and failures; on a release with the #48102 bug, whose soak stops at that finding,
# "finds #48102 (expected)" with the first failure when it is INV-1; else "FAILED" with it.
# Exit status: 0 when every release conforms or finds #48102 as conformance/releases.py
# expects, with no failed test (and no unexpected soak failure); 1 otherwise.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-python3}
out=${OUT:-/tmp/kvspec-conformance}
keep=${KEEP:-0}
soak=${SOAK_STEPS:-0}
soak_seed=${SOAK_SEED:-0}
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
    if ((soak > 0)); then
        echo "| release | verdict | soak ($soak steps a machine, seeds from $soak_seed) | tests (s) | build (s) |"
        echo "|---|---|---|---|---|"
    else
        echo "| release | verdict | tests (s) | build (s) |"
        echo "|---|---|---|---|"
    fi
} > "$summary"
cat "$summary"
status=0
for v in "${wanted[@]}"; do
    if [[ $v == 0.33.0 ]]; then name=.venv-vllm; else name=.venv-vllm-$v; fi  # as the Makefile
    venv="$root/$name"
    existed=0; [[ -e $venv ]] && existed=1
    log="$out/$v.log"
    rm -f "$out/$v.findings.txt"
    t0=$(date +%s)
    make -C "$root" --no-print-directory "$name/.vllm-version" VLLM_VERSION="$v" PY="$py" > "$log" 2>&1
    built=$?
    t1=$(date +%s)
    if ((built != 0)); then
        verdict="BUILD FAILED (see $log)"
        rc=1
    else
        make -C "$root" --no-print-directory conformance VLLM_VERSION="$v" PY="$py" >> "$log" 2>&1
        rc=$?
        failed=$(grep -E '^(FAILED|ERROR) tests/' "$log" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/' \
                 | sed -E 's#^tests/conformance/##' | sort -u | paste -sd ' ' -)
        bug=$("$py" -c "import sys; sys.path.insert(0, '$root'); from conformance import releases; print(int(releases.find('$v').bug_48102))")
        head="conforms"
        if ((bug)); then   # the finding a release with the bug must give (its test passes)
            if grep -q "^_* test_machine_finds_the_48102_stuck_request _*$" "$log" \
                    && [[ " $failed " != *" test_machine.py::test_machine_finds_the_48102_stuck_request "* ]]; then
                head="finds #48102 (expected): test_machine.py::test_machine_finds_the_48102_stuck_request"
            else
                head="#48102 NOT FOUND"
                rc=1
            fi
        fi
        if [[ -z $failed ]] && ((rc == 0)); then
            verdict="$head"
        else
            if [[ $head == conforms ]]; then verdict="FAILED"; else verdict="$head"; fi
            if [[ -n $failed ]]; then
                [[ $verdict == FAILED ]] && verdict="FAILED: $failed" \
                    || verdict="$verdict; FAILED: $failed"
            else
                verdict="$verdict (see $log)"
            fi
            "$py" - "$log" > "$out/$v.findings.txt" <<'PY'
import re, sys
text = open(sys.argv[1], errors="replace").read()
# the FAILURES block of the report; in it, "____ name ____" then each failure's traceback
blocks = re.findall(r"\n=+ (?:FAILURES|ERRORS) =+\n(.*?)(?=\n=+ [^=\n]+ =+\n|\Z)", text, re.S)
sections = re.split(r"\n_+ ([A-Za-z][^\n]*?) _+\n", "\n" + "\n".join(blocks))
for name, body in zip(sections[1::2], sections[2::2]):
    errors = re.findall(r"((?:\w+\.)*\w*(?:Error|Violation|Exception)\b: .*)", body)
    bare = re.findall(r"^E\s+(\S*(?:Error|Violation|Exception)\b.*)$", body, re.M)
    where = re.findall(r"^(\S+\.py:\d+): \w*(?:Error|Violation|Exception)$", body, re.M)
    first = (errors[0] if errors else f"{bare[0]} at {where[-1] if where else '?'}" if bare
             else "(no error line; see the log)")
    print(f"{name}: {first[:600]}")
PY
        fi
    fi
    t2=$(date +%s)
    soak_cell=""
    if ((soak > 0)); then
        if ((built != 0)); then
            soak_cell="-"
        else
            slog="$out/$v.soak.log"
            make -C "$root" --no-print-directory conformance-soak VLLM_VERSION="$v" PY="$py" \
                VLLM_STEPS="$soak" SEED="$soak_seed" > "$slog" 2>&1
            src=$?
            totals=$(awk '/^=+ soak =+$/ {on = 1; next} on && /^vllm/ {print $1 ": " $4 " steps, " $7 " failures"}' "$slog" | paste -sd ';' - | sed 's/;/; /g')
            first=$(grep -m1 -E '^vllm(-hybrid)? seed [0-9]+, program' "$slog")
            if ((src == 0)); then
                soak_cell="${totals:-no totals (see $slog)}"
            elif ((bug)) && [[ $first == *INV-1* ]]; then
                soak_cell="finds #48102 (expected): $first"
            else
                soak_cell="FAILED: ${first:-see $slog}"
                rc=1
            fi
        fi
        soak_cell="$soak_cell | "
    fi
    ((rc == 0)) || status=1
    if ((existed == 0)) && [[ $keep != 1 ]]; then
        rm -rf "$venv"
    fi
    row="| $v | $verdict | $soak_cell$((t2 - t1)) | $((t1 - t0)) |"
    echo "$row" >> "$summary"
    echo "$row"
    if [[ -s $out/$v.findings.txt ]]; then
        sed "s/^/    $v: /" "$out/$v.findings.txt"
    fi
done
for v in "${wanted[@]}"; do
    if [[ -s $out/$v.findings.txt ]]; then
        { echo; echo "## $v: failed tests, first error"; echo; sed 's/^/- /' "$out/$v.findings.txt"; } >> "$summary"
    fi
done
echo
echo "summary: $summary (logs: $out/RELEASE.log)"
exit $status
