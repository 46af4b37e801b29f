#!/usr/bin/env bash
# The one command for a GPU machine (issue 13): the cuda test tier, then the quick GPU benchmark.
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh        # from the repository root
#
# Expects torch (with CUDA) already installed. Makes fxspeed importable (pip install -e . --no-deps,
# or a PYTHONPATH shim when pip cannot install), installs pytest / transformers / safetensors /
# hypothesis and fxspeed's small dependencies only when they are missing (PyPI only, nothing else
# is downloaded: HF models are built from configs, offline), then runs
#
#     tests/test_cuda.py and the kernel tests   (pytest -m cuda, capped at TEST_TIMEOUT_S, junit XML in $OUT)
#     benchmarks/bench_gpu.py --quick --out $OUT/bench_gpu.json   (capped at BENCH_TIMEOUT_S)
#     benchmarks/bench_inference.py on HF Llama 0.94B bf16          (capped at SERVE_TIMEOUT_S; issue 16:
#         batch 1 and 16 against HF eager and the bandwidth limit, with and without CUDA graphs,
#         then the 64-request workload against HF generate in batches of 16 and generate_batch)
#
# Everything is logged to $OUT/gpu_check.log. Each step runs even if an earlier one failed; the
# exit status is non-zero if any failed. Expected wall time on one H200: about 7-8 minutes
# (worst case, every step hitting its cap, under 12 minutes plus the installs). Under a 10-minute
# limit per command, lower the caps: TEST_TIMEOUT_S=200 BENCH_TIMEOUT_S=150 SERVE_TIMEOUT_S=180.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-240}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-240}
SERVE_TIMEOUT_S=${SERVE_TIMEOUT_S:-240}
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false
START=$SECONDS
status=0

log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
run() { "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

pip_install() {  # pip install "$@", retrying past an externally-managed system Python
    run "$PY" -m pip install -q --disable-pip-version-check "$@" && return 0
    log "pip install $* failed; retrying with --break-system-packages"
    run "$PY" -m pip install -q --disable-pip-version-check --break-system-packages "$@"
}

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

log "repository $ROOT, output $OUT"
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
run "$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"available {torch.cuda.is_available()}  devices {torch.cuda.device_count()}")
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0))
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
EOF

# --- dependencies: only what is missing -----------------------------------------------------
missing=()
for mod in networkx sympy tqdm psutil pytest hypothesis transformers safetensors; do
    have "$mod" || missing+=("$mod")
done
if ((${#missing[@]})); then
    log "installing missing: ${missing[*]}"
    pip_install "${missing[@]}" || { log "could not install ${missing[*]}"; status=1; }
else
    log "dependencies present"
fi

# --- fxspeed itself ---------------------------------------------------------------------------
log "installing fxspeed (editable, no deps)"
if ! pip_install --no-deps --no-build-isolation -e . && ! pip_install --no-deps -e .; then
    # The package maps fxspeed.passes -> passes/ and fxspeed.runtime -> runtime/ (pyproject.toml);
    # a sitecustomize on PYTHONPATH installs the mapping the editable install would have.
    log "pip could not install fxspeed: using a PYTHONPATH shim (sitecustomize) instead"
    SHIM=$(mktemp -d)
    cat > "$SHIM/sitecustomize.py" <<PYEOF
import importlib.util, os, sys
_MAP = {"fxspeed.passes": "$ROOT/passes", "fxspeed.runtime": "$ROOT/runtime"}
class _FxspeedShim:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        d = _MAP.get(name)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(d, "__init__.py"),
                                                      submodule_search_locations=[d])
sys.meta_path.append(_FxspeedShim)
PYEOF
    export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd /tmp && run "$PY" -c "import fxspeed, fxspeed.runtime, fxspeed.passes; print('fxspeed from', fxspeed.__file__)"); then
    log "fxspeed does not import: stopping"
    exit 1
fi
# Without transformers the HF tests skip and the benchmark's HF runs report an error; go on.
run "$PY" -c "import transformers; print('transformers', transformers.__version__)" || status=1

# --- the cuda test tier -----------------------------------------------------------------------
# No -x: this run is scarce, so every test reports; -s prints each low-precision test's
# numbers (losses, update cosine and drift from fp32, fxspeed vs autocast).
# every file with cuda tests: the end-to-end ones, then each fused kernel compiled against torch
CUDA_TESTS=(tests/test_cuda.py tests/test_fusion_kernels.py tests/test_fusion_rotary.py tests/test_fusion_activations.py
            tests/test_fusion_residual_norms.py tests/test_paged_attention_kernel.py tests/test_cross_entropy_kernel.py
            tests/test_fold_norm_casts.py)
log "pytest -m cuda ${CUDA_TESTS[*]} (cap ${TEST_TIMEOUT_S}s)"
run timeout -k 10 "$TEST_TIMEOUT_S" "$PY" -m pytest -m cuda -q -s -rA -p no:cacheprovider "${CUDA_TESTS[@]}" \
    --junitxml="$OUT/test_cuda.xml"
rc=$?
log "pytest exit status $rc"
((rc == 0)) || status=1

# --- the quick benchmark ----------------------------------------------------------------------
log "bench_gpu.py --quick (cap ${BENCH_TIMEOUT_S}s)"
run timeout -k 10 "$BENCH_TIMEOUT_S" "$PY" benchmarks/bench_gpu.py --quick --out "$OUT/bench_gpu.json"
rc=$?
log "bench_gpu.py exit status $rc"
((rc == 0)) || status=1

# --- serving (issue 16): each row is printed as it is measured, so a capped run keeps its rows ---
log "bench_inference.py --device cuda --model llama-0.94b --precision bf16 (cap ${SERVE_TIMEOUT_S}s)"
run timeout -k 10 "$SERVE_TIMEOUT_S" "$PY" benchmarks/bench_inference.py --device cuda --model llama-0.94b \
    --precision bf16 --batches 1 16 --prompt 32 --new 64 --repeats 2 --token-budget 512 \
    --workload 64 --prompt-range 32 512 --new-range 32 256 --out "$OUT/bench_inference_gpu.json"
rc=$?
log "bench_inference.py exit status $rc"
((rc == 0)) || status=1

log "done in $((SECONDS - START))s, status $status; files: $(ls "$OUT" | tr '\n' ' ')"
exit $status
