#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 60), starting from the committed seeds
# (fuzz/seeds/TARGET) and the corpus of earlier runs (fuzz/corpus/TARGET, not committed).
# Prints executions and findings per target; exits 1 if any target found a crash, whose
# input is then in fuzz/artifacts/TARGET/. On demand, not in CI: CI replays the seeds through
# the targets' checks in the plain test suite (tests/fuzz_seeds.rs), without this build.
#
#   fuzz/run.sh [SECONDS] [TARGET...]
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`); works on stable Rust (RUSTC_BOOTSTRAP=1).
# Built with debug assertions and overflow checks (-a): an overflow that a release build
# would wrap silently is a finding.
set -uo pipefail
cd "$(dirname "$0")"
export RUSTC_BOOTSTRAP=1
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)

cargo fuzz build -a || exit 1
mkdir -p logs
failed=0
printf '%-16s %12s %8s %8s  %s\n' target execs exec/s corpus result
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    dict=()
    case $t in
        config) dict=(-dict=dicts/config.dict) ;;
        tar) dict=(-dict=dicts/tar.dict) ;;
        braces) dict=(-dict=dicts/braces.dict) ;;
        request) dict=(-dict=dicts/request.dict) ;;
    esac
    cargo fuzz run -a "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        "${dict[@]}" >"logs/$t.log" 2>&1
    rc=$?
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "logs/$t.log" | grep -o '[0-9]*$')
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "logs/$t.log" | grep -o '[0-9]*$')
    corpus=$(find "corpus/$t" -type f | wc -l)
    if [ $rc -eq 0 ]; then
        result="no findings"
    else
        result="FOUND: $(grep -m1 -E '^(==[0-9]+==ERROR|thread .* panicked|.*Test unit written)' "logs/$t.log" | cut -c1-100) (logs/$t.log)"
        failed=1
    fi
    printf '%-16s %12s %8s %8s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "$corpus" "$result"
done
exit $failed
