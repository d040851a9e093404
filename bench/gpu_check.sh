#!/usr/bin/env bash
# The one prepared check for a machine with an NVIDIA GPU and no network (the device tool's
# H200 has Python 3.12 with numpy, CuPy, pytest, tokenizers and jinja2). It installs nothing
# from the network: the few pure-Python packages it lacks travel as wheels in .whl/
# (make them here with `bash bench/gpu_check.sh --fetch-wheels`, then carry `.whl`).
# Finishes well inside 10 minutes; everything it measures lands in $OUT (default
# /tmp/gpu_check): the CUDA source build, the CUDA parity tests (every op, the tiny llama
# in F32 / Q8_0 / Q4_1 against numpy, the quantized semantics' quantizer and integer
# matmuls against llama.cpp's bytes and vec_dot), the engine's greedy parity on --device cuda when the
# SmolLM2 GGUF is present, tensor parallelism over NCCL when the machine has two GPUs, and a
# decode/prefill sweep of bench/profile_step.py.
#
#   device run: bash bench/gpu_check.sh        (carry: .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="msgspec pyzmq gguf"

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  for name in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "$name" || exit 1
  done
  ls -la .whl
  exit 0
fi

OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
status=0

{ nvidia-smi; nvcc --version; python3 -c "import cupy; print('cupy', cupy.__version__)"; } \
  > "$OUT/machine.txt" 2>&1

echo "== CUDA sources and parity tests" | tee "$OUT/tests.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels/test_cuda_sources.py tests/kernels/test_device_ops.py \
  tests/kernels/test_device_model.py tests/kernels/test_device_activations.py \
  -k "cuda or nvcc or sources" 2>&1 | tee -a "$OUT/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

# NCCL all-reduce between two CUDA worker processes (a tiny llama at TP=2 against numpy at
# TP=1); skips with a message on a machine with one GPU (NCCL refuses two ranks on one GPU)
echo "== tensor parallel on CUDA workers (NCCL)" | tee -a "$OUT/tests.log"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" \
  tests/kernels/test_tp_devices.py -k cuda 2>&1 | tee -a "$OUT/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if python3 -c "from vllm_actors.loaders.model_files import default_model_path as d; \
               raise SystemExit(d() is None)" 2>/dev/null; then
  echo "== SmolLM2 greedy parity on --device cuda" | tee -a "$OUT/tests.log"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/integration/test_device_engine.py -k cuda 2>&1 | tee -a "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "== throughput sweep (bench/profile_step.py, SmolLM2)" > "$OUT/sweep.txt"
  for args in "--batch 1 --context 160" "--batch 32 --context 160" "--batch 128 --context 160" \
              "--batch 1 --context 512 --query 512" "--batch 1 --context 2048 --query 2048"; do
    timeout 60 python3 bench/profile_step.py --device cuda --steps 5 $args >> "$OUT/sweep.txt" 2>&1 \
      || { echo "sweep failed: $args" | tee -a "$OUT/tests.log"; status=1; }
  done
else
  echo "== SmolLM2 is not installed here (its 93 MB wheel exceeds what a device call can" \
       "carry): engine parity and the sweep were skipped" | tee -a "$OUT/tests.log"
fi
echo "gpu_check status: $status" | tee -a "$OUT/tests.log"
exit $status
