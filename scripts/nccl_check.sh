#!/usr/bin/env bash
# The NCCL backend on a CUDA machine: the collective suite and the TP-parity run of
# bert_pretrain, one process per GPU. CI cannot run this (no GPU there; it builds the
# `cuda` feature instead). Needs the NVIDIA driver, NVRTC, libnccl, python3, and two GPUs or more:
# NCCL refuses two ranks of one communicator on the same GPU.
#
#   scripts/nccl_check.sh            # all GPUs
#   NCCL_CHECK_GPUS=2 scripts/nccl_check.sh
#
# The processes are started with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT) by this script itself, so torchrun is not needed.
set -euo pipefail
cd "$(dirname "$0")/.."

gpus=${NCCL_CHECK_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if (( gpus < 2 )); then
  echo "nccl_check: needs 2 GPUs or more, found $gpus" >&2
  exit 2
fi
out=${NCCL_CHECK_OUT:-target/nccl_check}
mkdir -p "$out"

cargo build --release -p burn-megatron-tests --features cuda --bin comm_suite
cargo build --release -p burn-megatron-examples --features cuda --example bert_pretrain

# launch N LOG CMD...: N processes of CMD with torchrun's variables; fails if any fails.
launch() {
  local n=$1 log=$2; shift 2
  local port=$((20000 + RANDOM % 20000)) pids=() status=0
  for ((r = 0; r < n; r++)); do
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$@" >"$log.$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=$?; done
  return $status
}

for ((n = 2; n <= gpus && n <= 4; n++)); do
  echo "== collectives over NCCL at $n processes"
  COMM_SUITE_TIMEOUT_S=60 launch "$n" "$out/collectives-$n" \
    target/release/comm_suite collectives nccl
  grep -h "equal the local backend" "$out/collectives-$n".*
done

echo "== a mismatched collective fails on every rank, naming the group and op"
start=$SECONDS
if COMM_SUITE_TIMEOUT_S=20 launch 2 "$out/mismatch" target/release/comm_suite mismatch nccl; then
  echo "nccl_check: the mismatch case succeeded" >&2
  exit 1
fi
grep -l "collective mismatch on group 'tp'" "$out"/mismatch.* >/dev/null
echo "   failed after $((SECONDS - start)) s"

echo "== bert_pretrain TP 2 over NCCL against the threaded run on the CPU"
args=(--tensor-model-parallel-size 2 --world-size 2 --num-layers 2 --hidden-size 64
      --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 8
      --train-iters 10 --lr 3e-3 --synthetic-documents 600 --log-interval 1
      --eval-interval 1000 --no-progress --loss-plot "$out/loss.png")
target/release/examples/bert_pretrain "${args[@]}" --log-json "$out/threads.json" >"$out/threads.log"
launch 2 "$out/nccl" target/release/examples/bert_pretrain "${args[@]}" \
  --distributed-backend nccl --log-json "$out/nccl.json"
python3 - "$out/threads.json" "$out/nccl.json" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert len(a) == len(b) == 10, (len(a), len(b))
worst = 0.0
for x, y in zip(a, b):
    for k in ("lm_loss", "sop_loss", "grad_norm"):
        rel = abs(x[k] - y[k]) / max(abs(x[k]), 1e-12)
        worst = max(worst, rel)
        # CPU and GPU kernels round differently; a wrong collective is off by far more.
        assert rel < 1e-3, (x["iteration"], k, x[k], y[k])
print(f"   10 iterations: losses and grad norms within {worst:.1e} relative of the CPU run")
PY
echo "nccl_check: all passed"
