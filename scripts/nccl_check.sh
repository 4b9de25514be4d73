#!/usr/bin/env bash
# The NCCL backend on a CUDA machine, one process per rank: the collective suite, its failure
# cases, every parallel layout of the Llama-style GPT and of BERT trained on CUDA against the
# same layout on threads on the CPU, and a checkpoint carried across layouts and devices.
# CI cannot run this (no GPU there; it builds the `cuda` feature and runs the CPU halves).
# Needs the NVIDIA driver, NVRTC, libnccl.so.2 and python3.
#
#   scripts/nccl_check.sh            # builds the binaries (release), then runs
#   NCCL_CHECK_BIN=dir scripts/nccl_check.sh   # prebuilt comm_suite, gpt_pretrain and
#                                              # bert_pretrain in dir (the GPU machine)
#   NCCL_CHECK_GPUS=2 NCCL_CHECK_JOBS=6 NCCL_CHECK_OUT=dir ...
#
# The processes get torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
# MASTER_PORT) from this script, so torchrun is not needed. With more ranks than GPUs (one
# H200) the ranks share them, for correctness, not speed: the launch maps LOCAL_RANK onto the
# GPUs and gives each rank that shares one an NCCL_HOSTID of its own (NCCL refuses two ranks
# of a communicator on one device of one host), and NCCL_SOCKET_IFNAME=lo keeps NCCL's socket
# transport on loopback. Checks run NCCL_CHECK_JOBS at a time (default 6), the longest first,
# each bounded (240 s), and none starts after NCCL_CHECK_DEADLINE_S (default 400 s) would
# cut it short: a check that ends without a verdict (killed by its bound, crashed) is a FAIL,
# one never started a SKIP. One line per check, sorted at the end, and in summary.txt beside
# the logs (under $OUT on the device machine, so that they come back). Terminated, it stops
# its checks and prints what finished. Exit status 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

# (no nvidia-smi counts as no GPU, not as a failed pipeline; MIG instances are not GPUs)
gpus=${NCCL_CHECK_GPUS:-$( (timeout 20 nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ')}
if ((gpus < 1)); then
  echo "nccl_check: needs a GPU, found none" >&2
  exit 2
fi
out=${NCCL_CHECK_OUT:-${OUT:-target}/nccl_check}
rm -rf "$out" && mkdir -p "$out/results"
jobs_at_once=${NCCL_CHECK_JOBS:-6}

if [ -n "${NCCL_CHECK_BIN:-}" ]; then
  bin=$NCCL_CHECK_BIN
else
  cargo build --release -p burn-megatron-tests -p burn-megatron-examples --features cuda \
    --bin comm_suite --example gpt_pretrain --example bert_pretrain || exit 1
  bin=target/release
  ln -sf examples/gpt_pretrain examples/bert_pretrain "$bin/" 2>/dev/null
fi
for b in comm_suite gpt_pretrain bert_pretrain; do
  [ -x "$bin/$b" ] || { echo "nccl_check: no $bin/$b" >&2; exit 2; }
done
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
# Ranks on one machine as separate hosts talk over sockets on loopback, not an HCA's loopback;
# an inherited NCCL_HOSTID would put every rank on one host (the same-host-id check sets its
# own); NCCL says why it failed in the rank logs. NCCL_RUNTIME_CONNECT=0 connects each
# communicator's collective transports in its (bounded) initialisation rather than in its
# first collective, where a dead peer would hold the host with no deadline.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_RUNTIME_CONNECT=${NCCL_RUNTIME_CONNECT:-0}
unset NCCL_HOSTID
# Ranks sharing a GPU need its compute mode Default (EXCLUSIVE_PROCESS refuses the second).
mode=$( (timeout 20 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null || true) | head -1)
echo "nccl_check: GPU compute mode ${mode:-unknown}"

# result NAME VERDICT DETAIL: one line into the results (printed, sorted, at the end); it
# replaces the job's placeholder verdict.
result() {
  echo "$2 $1: $3" >"$out/results/$(tr -c 'A-Za-z0-9_.-' _ <<<"$1")"
  rm -f "${JOB_PENDING:-}"
}

# launch PORT N LOG CMD...: N processes of CMD with torchrun's variables; fails if any does.
# With LAUNCH_FAIL_FAST=1, the first rank that fails takes the others down at once (a rank
# that died before its peers connected would leave them waiting out their timeout).
launch() {
  local port=$1 n=$2 log=$3 pids=() status=0 r p
  shift 3
  for ((r = 0; r < n; r++)); do
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$@" >"$log.$r" 2>&1 &
    pids+=($!)
  done
  if [ "${LAUNCH_FAIL_FAST:-}" != 1 ]; then
    for p in "${pids[@]}"; do wait "$p" || status=$?; done
    return $status
  fi
  local alive=("${pids[@]}") still
  while ((${#alive[@]})); do
    sleep 0.2
    still=()
    for p in "${alive[@]}"; do
      if kill -0 "$p" 2>/dev/null; then
        still+=("$p")
        continue
      fi
      wait "$p"
      r=$?
      if ((r != 0 && status == 0)); then
        status=$r
        kill -TERM "${pids[@]}" 2>/dev/null
      fi
    done
    alive=("${still[@]}")
  done
  return $status
}

# --- the collective suite and its failures -------------------------------------------------

job_collectives() { # PORT N
  local log=$out/collectives-$2 start=$SECONDS
  if COMM_SUITE_TIMEOUT_S=60 launch "$1" "$2" "$log" "$bin/comm_suite" collectives nccl &&
    (($(cat "$log".* | grep -c "equal the local backend") == $2)); then
    result "collectives at $2" PASS "every op and dtype (f32, f16, bf16, i32, i64; 0, 1 and odd sizes) equals the local backend on every rank; $((SECONDS - start)) s"
  else
    result "collectives at $2" FAIL "$(grep -h -m2 -E "error|panicked" "$log".* | head -2)"
  fi
}

job_tensors() { # PORT N: comm::tensor and the all-to-all on CUDA tensors against CPU tensors
  local log=$out/tensors-$2 start=$SECONDS
  if COMM_SUITE_TIMEOUT_S=60 launch "$1" "$2" "$log" "$bin/comm_suite" tensors nccl &&
    (($(cat "$log".* | grep -c "on the device path equal") == $2)); then
    result "tensors at $2" PASS "$(grep -h -o "[0-9]* tensor ops.*" "$log.0") (f32, bf16, f16: all-reduce, all-gather, reduce-scatter, send/recv across paths, all-to-all with empty pieces and mixed paths); $((SECONDS - start)) s"
  else
    result "tensors at $2" FAIL "$(grep -h -m2 -E "error|panicked|host \(" "$log".* | head -2)"
  fi
}

job_large() { # PORT N
  local log=$out/large-$2
  if COMM_SUITE_TIMEOUT_S=120 launch "$1" "$2" "$log" "$bin/comm_suite" large nccl; then
    result "64 MiB at $2" PASS "$(grep -h -o "64 MiB.*" "$log.0")"
  else
    result "64 MiB at $2" FAIL "$(grep -h -m2 -E "error|panicked" "$log".* | head -2)"
  fi
}

job_mismatch() { # PORT
  local log=$out/mismatch start=$SECONDS
  if COMM_SUITE_TIMEOUT_S=20 launch "$1" 2 "$log" "$bin/comm_suite" mismatch nccl; then
    result "mismatch" FAIL "a mismatched collective succeeded"
  elif (($(grep -l "collective mismatch on group 'tp'" "$log".* | wc -l) == 2)); then
    result "mismatch" PASS "an error naming group 'tp' on both ranks after $((SECONDS - start)) s"
  else
    result "mismatch" FAIL "$(grep -h -m1 error "$log".*)"
  fi
}

job_killed_peer() { # PORT: 4 ranks, the last SIGKILLs itself; the others must fail in time
  local log=$out/killed start=$SECONDS
  COMM_SUITE_TIMEOUT_S=20 launch "$1" 4 "$log" "$bin/comm_suite" killed-peer nccl
  local took=$((SECONDS - start))
  local failed_in_time
  failed_in_time=$(grep -l "the all-reduce failed after" "$log".0 "$log".1 "$log".2 | wc -l)
  if ((failed_in_time == 3)) && grep -q "killing myself" "$log.3" && ((took < 90)); then
    result "killed peer" PASS "3 of 4 ranks' all-reduce failed, the job ended in $took s (timeout 20 s): $(grep -h -o "failed after.*" "$log.0" | cut -c1-160)"
  else
    result "killed peer" FAIL "$failed_in_time of 3 survivors failed in time; $took s"
  fi
}

job_same_host_id() { # PORT: ranks sharing a GPU under one user NCCL_HOSTID
  local log=$out/same-host-id
  if NCCL_HOSTID=one-host COMM_SUITE_TIMEOUT_S=20 launch "$1" 2 "$log" \
    "$bin/comm_suite" collectives nccl; then
    result "one NCCL_HOSTID on a shared GPU" FAIL "it ran"
  elif (($(grep -l "have the same NCCL_HOSTID" "$log".* | wc -l) == 2)); then
    result "one NCCL_HOSTID on a shared GPU" PASS "an error naming NCCL_HOSTID on both ranks, before NCCL"
  else
    result "one NCCL_HOSTID on a shared GPU" FAIL "$(grep -h -m1 -i error "$log".*)"
  fi
}

# --- training: every layout on CUDA over NCCL against threads on the CPU --------------------

common=(--hidden-size 64 --num-attention-heads 4 --seq-length 64
  --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 3e-3
  --synthetic-documents 600 --hidden-dropout 0 --attention-dropout 0 --log-interval 1
  --eval-interval 0 --no-progress --distributed-timeout-minutes 2)
gpt=(--group-query-attention --num-query-groups 2 --position-embedding-type rope
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --generate-tokens 0 --vocab-size 400)
# f32 on both sides: only the kernels' and the collectives' orders of summation differ.
limit=1e-5

# with_defaults FLAGS...: the flags, plus 2 layers and TP 1 where they do not say otherwise
# (the examples' default TP is 2).
with_defaults() {
  local given=" $* "
  [[ $given == *" --num-layers "* ]] || set -- "$@" --num-layers 2
  [[ $given == *" --tensor-model-parallel-size "* ]] || set -- "$@" --tensor-model-parallel-size 1
  echo "$@"
}

job_layout() { # PORT MODEL NAME WORLD FLAGS...
  local port=$1 model=$2 name=$3 n=$4
  shift 4
  local dir=$out/$model-$name
  mkdir -p "$dir"
  local args
  read -r -a args <<<"$(with_defaults "$@")"
  args+=("${common[@]}" --world-size "$n" --loss-plot "$dir/loss.png")
  [ "$model" = gpt ] && args+=("${gpt[@]}")
  local run=$bin/${model}_pretrain
  "$run" "${args[@]}" --device cpu --log-json "$dir/threads.json" \
    --loss-plot "$dir/loss-cpu.png" >"$dir/threads.log" 2>&1 &
  local ref=$!
  local start=$SECONDS
  LAUNCH_FAIL_FAST=1 launch "$port" "$n" "$dir/nccl" "$run" "${args[@]}" \
    --distributed-backend nccl --log-json "$dir/nccl.json"
  local status=$? took=$((SECONDS - start))
  wait "$ref" || { result "$model $name" FAIL "the CPU run failed: $(tail -2 "$dir/threads.log")"; return; }
  if ((status != 0)); then
    result "$model $name" FAIL "exit $status: $(grep -h -m2 -E "error|panicked" "$dir"/nccl.* | head -2)"
    return
  fi
  local line
  line=$(python3 scripts/compare_runs.py "nccl/cuda vs threads/cpu" \
    "$dir/threads.json" "$dir/nccl.json" "$limit")
  local verdict=${line%% *}
  # Time per step (the median over the iterations after the first two) and how the
  # point-to-point tensors of rank 0's process travelled.
  local ms p2p reads waits
  ms=$(python3 -c "import json, statistics, sys; v = [json.loads(l)['ms_per_iter'] for l in open(sys.argv[1]) if l.strip()][2:]; print(f'{statistics.median(v):.1f} ms/step' if v else '? ms/step')" "$dir/nccl.json" 2>/dev/null)
  p2p=$(grep -h -o "point-to-point tensors of this process: .*" "$dir/nccl.0" | head -1)
  # Rank 0's synchronisations per iteration: host reads, and host waits for NCCL's streams.
  reads=$(grep -h -o "host reads of device tensors per iteration.*" "$dir/nccl.0" | grep -o "[0-9.]*$" | head -1)
  waits=$(grep -h -o "host waits for NCCL streams per iteration (rank 0's thread): [0-9.]*" "$dir/nccl.0" | grep -o "[0-9.]*$" | head -1)
  result "$model $name" "$verdict" "${line#* }; $took s; ${ms:-? ms/step}; ${p2p:-no point-to-point tensors}; ${reads:-?} host reads and ${waits:-?} NCCL waits per iteration; $(grep -h -o "share CUDA device" "$dir"/nccl.* | wc -l) rank(s) shared a GPU"
}

# Saved at TP 2 x PP 2 on CUDA over NCCL after 10 of 20 iterations, loaded at TP 1 on the CPU
# and at DP 2 with the distributed optimizer on CUDA: both continue the saving run's losses.
job_checkpoint() { # PORT
  local port=$1 dir=$out/checkpoint model=gpt
  mkdir -p "$dir"
  local args=("${common[@]}" "${gpt[@]}" --num-layers 2 --loss-plot "$dir/loss.png")
  local run=$bin/gpt_pretrain
  if ! LAUNCH_FAIL_FAST=1 launch "$port" 4 "$dir/save" "$run" "${args[@]}" --world-size 4 \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --distributed-backend nccl \
    --save "$dir/ckpt" --save-interval 10 --log-json "$dir/saved.json"; then
    result "checkpoint tp2pp2 cuda -> tp1 cpu, dp2 cuda" FAIL "the saving run failed: $(grep -h -m1 error "$dir"/save.*)"
    return
  fi
  # (burn-optim puts a loaded optimizer state on Burn's default device: name the CPU's)
  BURN_DEVICE=flex "$run" "${args[@]}" --world-size 1 --tensor-model-parallel-size 1 --device cpu \
    --load "$dir/ckpt" --ckpt-step 10 --log-json "$dir/cpu.json" \
    --loss-plot "$dir/loss-cpu.png" >"$dir/cpu.log" 2>&1 &
  local cpu=$!
  LAUNCH_FAIL_FAST=1 launch $((port + 1)) 2 "$dir/dp2" "$run" "${args[@]}" --world-size 2 \
    --tensor-model-parallel-size 1 --use-distributed-optimizer --distributed-backend nccl \
    --load "$dir/ckpt" --ckpt-step 10 --log-json "$dir/dp2.json" --loss-plot "$dir/loss-dp2.png"
  local dp2=$?
  wait "$cpu"
  local cpu_status=$? lines=() verdicts=PASS l
  ((cpu_status == 0)) && lines+=("$(python3 scripts/compare_runs.py "tp1 cpu" "$dir/saved.json" "$dir/cpu.json" 1e-4 --from 11)") ||
    lines+=("FAIL tp1 cpu: exit $cpu_status")
  ((dp2 == 0)) && lines+=("$(python3 scripts/compare_runs.py "dp2 cuda" "$dir/saved.json" "$dir/dp2.json" 1e-4 --from 11)") ||
    lines+=("FAIL dp2 cuda: exit $dp2")
  for l in "${lines[@]}"; do [ "${l%% *}" = PASS ] || verdicts=FAIL; done
  result "checkpoint tp2pp2 cuda -> tp1 cpu, dp2 cuda" "$verdicts" "$(printf '%s; ' "${lines[@]#* }")"
}

# --- the run ----------------------------------------------------------------------------------

# Below the ephemeral range (32768 and up), where NCCL's own sockets are bound.
port=$((20000 + RANDOM % 12000))
running=0
job=0
start=$SECONDS
deadline=${NCCL_CHECK_DEADLINE_S:-400}
# spawn FUNCTION ARGS...: runs a job in the background, at most $jobs_at_once together, each
# with a fresh block of ports, bounded by 240 s and by the deadline. A placeholder FAIL stands
# for its verdict until the job writes one; a job there is no time left for is a SKIP.
spawn() {
  while ((running >= jobs_at_once)); do
    wait -n
    running=$((running - 1))
  done
  local f=$1 left=$((deadline - (SECONDS - start)))
  shift
  job=$((job + 1))
  local pending=$out/results/pending-$job tag="$f ${*//--/}"
  if ((left < 45)); then
    echo "SKIP $tag: not started, ${left} s left of the ${deadline} s deadline" >"$pending"
    return
  fi
  local limit=$((left < 240 ? left : 240))
  echo "FAIL $tag: no verdict within its ${limit} s (killed by its bound, or crashed; logs in $out)" >"$pending"
  JOB_PENDING=$pending timeout -k 10 "$limit" bash -c "$(declare -f result launch with_defaults "$f"); \
    $(declare -p out bin common gpt limit); $f $port $*" &
  port=$((port + 10))
  running=$((running + 1))
}

report() {
  echo "== nccl_check: $((SECONDS - start)) s"
  sort -k2 "$out"/results/* | tee "$out/summary.txt"
  local n_fail
  n_fail=$(cat "$out"/results/* | grep -c "^FAIL ")
  ((n_fail == 0)) || { echo "== failed:"; grep -h "^FAIL " "$out"/results/* | cut -c1-400; }
  echo "== $n_fail failure(s) of $(ls "$out/results" | wc -l) checks" | tee -a "$out/summary.txt"
  ((n_fail == 0))
}
# Terminated (the caller's bound): stop the running checks (each `timeout` passes the signal
# on to its job's processes), then report what finished.
stop() {
  trap - TERM INT
  echo "== nccl_check: terminated after $((SECONDS - start)) s; stopping the running checks"
  kill -TERM $(jobs -p) 2>/dev/null
  wait
  report
  exit 124
}
trap stop TERM INT

echo "nccl_check: $gpus GPU(s), $jobs_at_once checks at a time, deadline ${deadline} s, logs in $out"
# The longest first (three runs, then the four-rank layouts), so that a slow machine cuts
# short the quick ones, which a second run can take.
spawn job_checkpoint
spawn job_layout gpt tp2xpp2 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
spawn job_layout bert tp2xpp2 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
# A ring of four: its pairs open in the group's order (Communicator::connect), not the
# ring's, which would wait on itself.
spawn job_layout gpt cp4-p2p 4 --context-parallel-size 4 --cp-comm-type p2p
spawn job_collectives 2
spawn job_collectives 4
spawn job_killed_peer
spawn job_mismatch
spawn job_large 2
spawn job_large 4
spawn job_tensors 2
spawn job_tensors 4
((gpus < 2)) && spawn job_same_host_id
for model in gpt bert; do
  spawn job_layout "$model" tp2-sp 2 --tensor-model-parallel-size 2 --sequence-parallel
  spawn job_layout "$model" pp2-1f1b 2 --pipeline-model-parallel-size 2
  spawn job_layout "$model" pp2-vp2 2 --pipeline-model-parallel-size 2 --num-layers 4 \
    --num-layers-per-virtual-pipeline-stage 1
  spawn job_layout "$model" dp2-distopt-overlap 2 --use-distributed-optimizer \
    --overlap-grad-reduce
  for cp in all_gather p2p a2a; do
    spawn job_layout "$model" "cp2-$cp" 2 --context-parallel-size 2 --cp-comm-type "$cp"
  done
done
# The ring with each block through the flash kernels (f32: the scalar set), against the
# CPU's flash op.
spawn job_layout gpt cp2-p2p-flash 2 --context-parallel-size 2 --cp-comm-type p2p \
  --attention-backend flash
# Data parallelism reduced after backward: buckets all-reduced (plain) and reduce-scattered
# (the distributed optimizer) in device memory.
spawn job_layout gpt dp2 2
spawn job_layout gpt dp2-distopt 2 --use-distributed-optimizer
# Overlapped with backward and all-reduced in place (the distributed optimizer's in-place
# reduce-scatter is the dp2-distopt-overlap layouts above).
spawn job_layout gpt dp2-overlap 2 --overlap-grad-reduce
# Four ranks on communicators of two groups at once: each rank's tensor-parallel collectives
# of backward on its main thread while its reducer's worker all-reduces buckets over the
# data-parallel group (synchronised BatchNorm's backward meets the worker the same way).
spawn job_layout gpt tp2-sp-dp2-overlap 4 --tensor-model-parallel-size 2 --sequence-parallel \
  --overlap-grad-reduce
# The same pipeline and ring with their messages through host memory, for the device path's
# effect.
BURN_MEGATRON_P2P=host spawn job_layout gpt pp2-1f1b-p2p-host 2 --pipeline-model-parallel-size 2
BURN_MEGATRON_P2P=host spawn job_layout gpt cp2-p2p-host 2 --context-parallel-size 2 \
  --cp-comm-type p2p
for dispatcher in alltoall allgather; do
  spawn job_layout gpt "ep2-$dispatcher" 2 --expert-model-parallel-size 2 --num-experts 4 \
    --moe-token-dispatcher-type "$dispatcher"
done
wait
report
