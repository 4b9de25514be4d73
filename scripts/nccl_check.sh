#!/usr/bin/env bash
# The NCCL backend on a CUDA machine: the collective suite and the TP-parity run of
# bert_pretrain, one process per rank. CI cannot run this (no GPU there; it builds the
# `cuda` feature instead). Needs the NVIDIA driver, NVRTC, libnccl and python3.
#
#   scripts/nccl_check.sh            # all GPUs, one rank per GPU (2 to 4 ranks)
#   NCCL_CHECK_GPUS=2 scripts/nccl_check.sh
#   NCCL_CHECK_BIN=dir scripts/nccl_check.sh   # prebuilt comm_suite and bert_pretrain in dir
#                                              # (a machine with no Rust registry)
#
# The processes are started with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT) by this script itself, so torchrun is not needed.
#
# With fewer GPUs than ranks (one H200), the ranks share a GPU for correctness, not speed:
# NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless
# each process takes itself for another host. Each process then gets its own NCCL_HOSTID and
# LOCAL_RANK 0 (each "host" has one GPU), and NCCL's socket transport runs on loopback
# (NCCL_SOCKET_IFNAME=lo). Measured with PyTorch's NCCL 2.28 on one H200: world 2 and 4
# initialise and all_reduce, all_gather, send and recv give the right values, at 1-2 GB/s.
set -euo pipefail
cd "$(dirname "$0")/.."

# (no nvidia-smi counts as no GPU, not as a failed pipeline under `set -e`)
gpus=${NCCL_CHECK_GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
if (( gpus < 1 )); then
  echo "nccl_check: needs a GPU, found none" >&2
  exit 2
fi
out=${NCCL_CHECK_OUT:-target/nccl_check}
mkdir -p "$out"

if [ -n "${NCCL_CHECK_BIN:-}" ]; then
  comm_suite=$NCCL_CHECK_BIN/comm_suite bert_pretrain=$NCCL_CHECK_BIN/bert_pretrain
else
  cargo build --release -p burn-megatron-tests --features cuda --bin comm_suite
  cargo build --release -p burn-megatron-examples --features cuda --example bert_pretrain
  comm_suite=target/release/comm_suite bert_pretrain=target/release/examples/bert_pretrain
fi

# launch N LOG CMD...: N processes of CMD with torchrun's variables; fails if any fails.
launch() {
  local n=$1 log=$2; shift 2
  local port=$((20000 + RANDOM % 20000)) pids=() status=0
  for ((r = 0; r < n; r++)); do
    if (( n <= gpus )); then
      RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        "$@" >"$log.$r" 2>&1 &
    else
      # Ranks sharing a GPU: one "host" each (see the top of this file).
      RANK=$r WORLD_SIZE=$n LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        NCCL_HOSTID="burn-megatron-nccl-check-$r" NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} \
        "$@" >"$log.$r" 2>&1 &
    fi
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=$?; done
  return $status
}

for n in 2 4; do
  echo "== collectives over NCCL at $n processes on $gpus GPU(s)"
  COMM_SUITE_TIMEOUT_S=60 launch "$n" "$out/collectives-$n" \
    "$comm_suite" collectives nccl
  grep -h "equal the local backend" "$out/collectives-$n".*
done

echo "== a mismatched collective fails on every rank, naming the group and op"
start=$SECONDS
if COMM_SUITE_TIMEOUT_S=20 launch 2 "$out/mismatch" "$comm_suite" mismatch nccl; then
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
"$bert_pretrain" "${args[@]}" --log-json "$out/threads.json" >"$out/threads.log"
launch 2 "$out/nccl" "$bert_pretrain" "${args[@]}" \
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
