#!/usr/bin/env bash
# Every GPU test, a short benchmark and the device copy bandwidth, with a summary table last.
# Run from the repository root: PYTHONPATH=. bash dev/gpu_check.sh
# It never stops at the first failure; full logs go to $OUT/gpu_check (or /tmp/gpu_check).
# It fails unless GPU tests really ran: with GDECODE_REQUIRE_GPU=1 a missing or broken GPU fails
# them instead of skipping, and "nothing collected" or "all skipped" is a failure too.
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
export GDECODE_REQUIRE_GPU=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
# `python -m cli.main` would run a second copy of cli.main whose app has no commands registered
GDECODE=("$PY" -c 'from cli.main import main; main()')
LOGS=${OUT:-${TMPDIR:-/tmp}}/gpu_check
mkdir -p "$LOGS"
NAMES=()
RESULTS=()
STATUS=0

section() { printf '\n==== %s ====\n' "$1"; }
record() { NAMES+=("$1"); RESULTS+=("$2"); }
fail() { record "$1" "$2"; STATUS=1; }

section "devices"
if smi=$(nvidia-smi -L 2>&1); then
    echo "$smi"
    record "nvidia-smi" "$(grep -c '^GPU' <<<"$smi") GPU(s): $(head -1 <<<"$smi" | sed 's/ (UUID.*//')"
else
    echo "$smi"
    fail "nvidia-smi" "FAILED"
fi

section "versions"
"$PY" - <<'EOF' 2>&1 | tee "$LOGS/versions.log"
import platform
print("python", platform.python_version())
for name in ("cuda.bindings", "cupy", "numpy", "torch"):
    try:
        print(name, __import__(name, fromlist=["__version__"]).__version__)
    except Exception as e:
        print(name, "unavailable:", e)
try:
    from cuda.bindings import driver
    from kernels.compiler import include_dirs, nvrtc_version
    from kernels.cuda import device_arch, gpu_available
    print("nvrtc", nvrtc_version(), "| CUDA headers", include_dirs() or "not found")
    driver.cuInit(0)
    print("driver", driver.cuDriverGetVersion()[1], "| gpu_available", gpu_available(),
          "| arch", device_arch() if gpu_available() else "-")
except Exception as e:
    print("driver/nvrtc:", type(e).__name__, e)
EOF

section "packages"
# what the tests and serve_bench import beyond the image's own packages: a missing one fails them all, so
# it is named here first (where they are not installed, pip install them from wheels before this script)
if missing=$("$PY" -c '
import importlib
bad = []
for name in ("gguf", "fastapi", "uvicorn", "httptools", "uvloop", "openai", "pytest"):
    try:
        importlib.import_module(name)
    except Exception as e:
        bad.append(f"{name} ({type(e).__name__}: {e})")
print("; ".join(bad) or "all importable")
raise SystemExit(1 if bad else 0)
' 2>&1); then
    echo "$missing"
    record "packages" "$missing"
else
    echo "$missing"
    fail "packages" "FAILED: $missing"
fi

section "pytest -m gpu"
rm -f "$LOGS/pytest.xml"
WORKERS=()
"$PY" -c 'import xdist' 2>/dev/null && WORKERS=(-n "${GPU_CHECK_WORKERS:-4}")
timeout "${GPU_CHECK_PYTEST_TIMEOUT:-420}" "$PY" -m pytest -q -m gpu "${WORKERS[@]}" -p no:cacheprovider \
    --tb=short --junitxml="$LOGS/pytest.xml" "${GPU_CHECK_TESTS:-tests}" -rs 2>&1 | tee "$LOGS/pytest.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ]; then
    fail "pytest -m gpu" "TIMEOUT after ${GPU_CHECK_PYTEST_TIMEOUT:-420}s"
elif line=$("$PY" dev/gpu_tests_ran.py "$rc" "$LOGS/pytest.xml" 2>&1); then
    record "pytest -m gpu" "$line"
else
    fail "pytest -m gpu" "$line"
fi

section "host cost per launch"
# printed by the test itself; run alone (no workers) so its output reaches the log
"$PY" -m pytest -q -s -p no:cacheprovider -p no:xdist tests/test_graph_gpu.py -k host_cost 2>&1 | tee "$LOGS/host.log"
line=$(grep -E 'host per graph replay' "$LOGS/host.log" | tail -1 | sed 's/^ *//')
if [ -n "$line" ]; then record "host cost" "$line"; else fail "host cost" "FAILED: not measured"; fi

section "bench"
# a short benchmark: the peers' shapes at the depths they were measured at, graph and eager
BENCHES=(
    "--shape llama3-8b --depth 0,8192,32768"
    "--shape llama3-8b --tests tg128 --no-graph"
    "--shape llama3-8b --tests tg128 --sample"
    "--shape qwen2.5-0.5b --depth 0,8192 --breakdown"
    "--shape qwen2.5-0.5b --tests tg128 --no-graph"
    "--shape qwen2.5-0.5b --tests tg128 --sample"
)
# quantized formats (random blocks made on the device); GDECODE_QUANT_BENCH=0 leaves them out
if [ "${GDECODE_QUANT_BENCH:-1}" != 0 ]; then
    BENCHES+=(
        "--shape llama3-8b --quant q4_k_m --depth 0,8192"
        "--shape llama3-8b --quant q4_0 --tests tg128"
        "--shape llama3-8b --quant q8_0 --tests tg128"
        "--shape llama3-8b --quant q6_k --tests tg128"
        "--shape qwen2.5-0.5b --quant q4_k_m --tests tg128"
        "--shape qwen2.5-0.5b --quant q8_0 --tests tg128"
    )
fi
[ -n "${GDECODE_BENCH_ARGS:-}" ] && BENCHES=("$GDECODE_BENCH_ARGS")
: >"$LOGS/bench.log"
for args in "${BENCHES[@]}"; do
    echo "\$ gdecode bench $args" | tee -a "$LOGS/bench.log"
    # shellcheck disable=SC2086  # args is a list of words on purpose
    timeout "${GPU_CHECK_BENCH_TIMEOUT:-240}" "${GDECODE[@]}" bench $args 2>&1 | tee -a "$LOGS/bench.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then record "bench" "ok: $args"; else fail "bench" "FAILED (rc=$rc): $args"; fi
done

section "serve"
# streamed tok/s and time to first token through the openai client against generate (needs the default model)
if [ -f models/smollm2-135m-instruct/config.json ]; then
    for args in "" "--shape llama3-8b"; do
        echo "\$ dev/serve_bench.py $args" | tee -a "$LOGS/serve.log"
        # shellcheck disable=SC2086
        timeout 240 "$PY" dev/serve_bench.py $args 2>&1 | tee -a "$LOGS/serve.log"
        rc=${PIPESTATUS[0]}
        if [ "$rc" -eq 0 ]; then record "serve bench" "ok: ${args:-smollm2}"; else fail "serve bench" "FAILED (rc=$rc): $args"; fi
    done
else
    record "serve bench" "skipped: no default model (make model)"
fi

section "copy bandwidth"
timeout 120 "$PY" -m kernels.bandwidth >"$LOGS/bandwidth.log" 2>&1
rc=$?
cat "$LOGS/bandwidth.log"
if [ "$rc" -eq 0 ]; then
    record "copy bandwidth" "$(tail -1 "$LOGS/bandwidth.log" | sed 's/^device copy bandwidth: //')"
else
    fail "copy bandwidth" "FAILED (rc=$rc)"
fi

section "summary"
for i in "${!NAMES[@]}"; do
    printf '%-16s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
done
printf '%-16s %s\n' "logs" "$LOGS"
echo
grep -E 'device copy bandwidth|^\$ gdecode bench|(tg|pp)[0-9]+' "$LOGS/bench.log" 2>/dev/null | grep -v 'kernel' || true
grep -E 'serve_bench|PASS|FAIL' "$LOGS/serve.log" 2>/dev/null || true
exit $STATUS
