#!/usr/bin/env bash
# plan's predicted per-rank peak against the peak gpt_pretrain / bert_pretrain measure (its counting
# allocator), at TP {1,2} x PP {1,2} x DP {1,2} x recompute {none, full}: the README's table.
# Needs the release examples (cargo build --release -p burn-megatron-examples --examples)
# and python3 (only to read the JSON).
# `scripts/plan_check.sh bert` checks bert_pretrain (default: gpt).
set -euo pipefail
MODEL=${1:-gpt}
M="--num-layers 4 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 704 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 --vocab-size 591 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --hidden-dropout 0 --attention-dropout 0"
if [ "$MODEL" = bert ]; then
  M="--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --vocab-size 191"
fi
for tp in 1 2; do for pp in 1 2; do for dp in 1 2; do for rc in none full; do
  R=""; [ $rc = full ] && R="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
  L="--tensor-model-parallel-size $tp --pipeline-model-parallel-size $pp --world-size $((tp*pp*dp))"
  plan=$(./target/release/examples/plan "$MODEL" $M $L $R --json)
  extra=""; [ "$MODEL" = gpt ] && extra="--generate-tokens 0"
  out=$(./target/release/examples/${MODEL}_pretrain $M $L $R --train-iters 3 --eval-interval 0 $extra 2>&1 | grep "memory of rank")
  python3 - "$tp" "$pp" "$dp" "$rc" "$plan" "$out" "$MODEL" <<'PY'
import json, re, sys
tp, pp, dp, rc, plan, out = sys.argv[1:7]
tp, pp, dp = int(tp), int(pp), int(dp)
stages = json.loads(plan)["stages"]
worst = 0.0
rows = []
for line in out.splitlines():
    m = re.search(r"memory of rank (\d+):.*\| peak ([\d.]+) MiB", line)
    r, peak = int(m.group(1)), float(m.group(2))
    stage = r // (tp * dp)
    pred = stages[stage]["total_bytes"] / 2**20
    err = (pred - peak) / peak
    worst = max(worst, abs(err))
    rows.append((stage, peak, pred, err))
per = {}
for s, peak, pred, err in rows:
    per.setdefault(s, []).append((peak, pred, err))
desc = " ".join(f"stage {s}: measured {max(p for p,_,_ in v):.1f} MiB, predicted {v[0][1]:.1f} MiB ({max((e for _,_,e in v), key=abs)*100:+.1f}%)" for s, v in sorted(per.items()))
print(f"| {sys.argv[7]} | TP {tp} PP {pp} DP {dp} | {rc} | {desc} | worst {worst*100:.1f}% |")
PY
done; done; done; done
