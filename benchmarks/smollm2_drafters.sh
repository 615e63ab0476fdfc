#!/usr/bin/env bash
# The embedded default's drafters, end to end, on CPU: distillation data, Orthrus heads and
# an EAGLE-3 drafter trained on the same rows with the same CPU budget, the acceptance
# curve, and the one-run comparison in vLLM (driver + vllm bench serve).
#
#   python -m benchmarks drafters STAGE [STAGE ...]
#   stages: data pack heldout train-eagle3 train-orthrus train-both train-long curve accept
#           ship-eagle3 accept-both curves profile compare bench-serve ablation
#
# Every stage is resumable (data shards, training checkpoints) or cheap to rerun. Paths:
# RUNS (default ./runs) holds data, drafters and results; OUT (default
# benchmarks/results/smollm2-drafters) the published figures. Budgets as run on
# 2026-11-24 (2-core AMD EPYC, shared): 60 CPU-minutes per drafter, one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
RUNS=${RUNS:-runs}
OUT=${OUT:-benchmarks/results/smollm2-drafters}
BASE=${BASE:-$($PY -c 'from diffspec.default_model import base_checkpoint; print(base_checkpoint())')}
DATA=$RUNS/sharegpt-smollm2-256
ANSWERS=${ANSWERS:-training/data/smollm2-sharegpt-answers.jsonl.gz}
CPU_MINUTES=${CPU_MINUTES:-60}
# longer runs (issue 28): RESUME=1 continues a run folder to a larger CPU_MINUTES / *_STEPS;
# ORTHRUS_RANK=full trains dense deltas (every projection weight) instead of rank-64 factors
ORTHRUS_RANK=${ORTHRUS_RANK:-64}
# WALL_MINUTES stops a training session (and saves) before the machine's session ends.
# ORTHRUS_INIT=HEADS starts a new Orthrus run from a heads folder (the shipped heads: the
# next session's training continues this one's, with a fresh optimizer and schedule)
ORTHRUS_INIT=${ORTHRUS_INIT:-}
ORTHRUS_LR=${ORTHRUS_LR:-2e-3}
# the recipe's other knobs: block size K, and extra trainer flags (--loss ce, --block-widths)
ORTHRUS_BLOCK=${ORTHRUS_BLOCK:-8}
ORTHRUS_EXTRA=${ORTHRUS_EXTRA:-}
ORTHRUS_STEPS=${ORTHRUS_STEPS:-200}
EAGLE3_STEPS=${EAGLE3_STEPS:-600}
ORTHRUS_RUN=${ORTHRUS_RUN:-$RUNS/orthrus-smollm2}
EAGLE3_RUN=${EAGLE3_RUN:-$RUNS/eagle3-smollm2}
# the shipped drafters: the Orthrus heads of the embedded default, the EAGLE-3 baseline
HEADS_SHIPPED=diffspec/assets/smollm2-orthrus-heads
EAGLE3_SHIPPED=${EAGLE3_SHIPPED:-benchmarks/drafters/smollm2-eagle3}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# bf16 autocast only where the CPU multiplies bf16 natively (AVX512-BF16 / AMX); emulated
# elsewhere, it costs ~3x the CPU time of fp32 (measured on a 2-core Intel Xeon, 2026-11-28)
BF16=${BF16-$($PY -c 'from diffspec.train import cpu_bf16_is_fast as f; print("--autocast-bf16" if f() else "")')}

stage() {
  case "$1" in
    data)  # the model's own greedy answers to ShareGPT's train prompts (vLLM, fp32)
      $PY -m diffspec.default_model --base-only
      # the run behind the published figures used the first 15 shards (3,840 prompts);
      # --max-prompts 3840 reproduces exactly those
      # answers already generated on an earlier machine are replayed from ANSWERS (seconds);
      # vLLM answers only the prompts it lacks
      replay=(); [ -f "$ANSWERS" ] && replay=(--replay-answers "$ANSWERS")
      $PY -m training.sharegpt generate --out "$DATA" --max-new-tokens 256 \
          --shard-size 256 --batch-size 64 --max-prompts "${MAX_PROMPTS:-3840}" "${replay[@]}" ;;
    pack)  # store the generated answers (no prompt text) for the next machine's data stage
      $PY -m training.sharegpt pack-answers --from "$DATA" --out "$ANSWERS" ;;
    heldout)  # held-out prompts (benchmark) and the model's answers to 48 of them (curve)
      $PY -m training.sharegpt held-out --out "$RUNS/heldout.jsonl"
      $PY -m training.sharegpt generate --split held-out --max-prompts 48 \
          --out "$RUNS/heldout-smollm2-256" --max-new-tokens 256 --shard-size 48 --batch-size 48 ;;
    train-eagle3)  # the baseline: vLLM's eagle3 layout, 16k draft vocabulary
      OMP_NUM_THREADS=1 $PY -m training.eagle3 --base "$BASE" --data "$DATA" \
          --out "$EAGLE3_RUN" --seq-len 512 --batch-size 4 --lr 1e-3 \
          --warmup-steps 20 --steps "$EAGLE3_STEPS" --draft-vocab 16384 $BF16 \
          --max-cpu-minutes "$CPU_MINUTES" --save-every 25 --log-every 5 ${RESUME:+--resume} \
          ${WALL_MINUTES:+--max-wall-minutes "$WALL_MINUTES"} ;;
    train-orthrus)  # ours: rank-64 heads (ORTHRUS_RANK), block 8, 64 answer anchors per row
      OMP_NUM_THREADS=1 $PY -m diffspec.train orthrus --base "$BASE" --data "$DATA" \
          --out "$ORTHRUS_RUN" --answers-only --rank "$ORTHRUS_RANK" --block-size "$ORTHRUS_BLOCK" \
          --mask-token-id 16 --num-anchors 64 --seq-len 512 --batch-size 4 --lr "$ORTHRUS_LR" \
          --warmup-steps 10 --steps "$ORTHRUS_STEPS" $BF16 --max-cpu-minutes "$CPU_MINUTES" \
          --save-every 10 --snapshot-every 25 --log-every 1 ${RESUME:+--resume} \
          ${ORTHRUS_INIT:+--init-heads "$ORTHRUS_INIT"} ${ORTHRUS_SEED:+--seed "$ORTHRUS_SEED"} \
          ${WALL_MINUTES:+--max-wall-minutes "$WALL_MINUTES"} $ORTHRUS_EXTRA ;;
    ablation)  # the heads recipe at equal CPU budget (issue 47): one arm after another on
      # the same rows (ABLATION_MINUTES each, resumable), each measured in vLLM by the accept
      # stage on the held-out prompts; ARMS picks some; the table: training.ablation_table
      for arm in ${ARMS:-base rank-full block-16 ce widths lr-5e-3}; do
        run=$RUNS/ablation/$arm; mkdir -p "$RUNS/ablation"
        [ -f "$run-accept/report.json" ] && continue
        ( case $arm in
            base) ;;
            rank-full) ORTHRUS_RANK=full ;;
            block-16) ORTHRUS_BLOCK=16 ;;
            ce) ORTHRUS_EXTRA="--loss ce" ;;
            widths) ORTHRUS_EXTRA="--block-widths 2,3,4,6,8" ;;
            lr-5e-3) ORTHRUS_LR=5e-3 ;;
            *) echo "unknown ablation arm $arm" >&2; exit 2 ;;
          esac
          RESUME=$([ -d "$run/checkpoint" ] && echo 1 || true) ORTHRUS_RUN=$run \
          CPU_MINUTES=${ABLATION_MINUTES:-30} ORTHRUS_STEPS=${ABLATION_STEPS:-2000} \
              stage train-orthrus > "$run.log" 2>&1
          HEADS=$run ACCEPT_OUT=$run-accept stage accept ) || exit $?
      done
      $PY -m training.ablation_table --runs "$RUNS/ablation" --out "$OUT/ablation" ;;
    train-both)  # both drafters side by side, one core each, the same CPU budget
      stage train-eagle3 > "$EAGLE3_RUN.log" 2>&1 & e=$!
      stage train-orthrus > "$ORTHRUS_RUN.log" 2>&1 & o=$!
      echo "training both drafters (logs: $EAGLE3_RUN.log, $ORTHRUS_RUN.log)"
      wait $e; wait $o ;;
    train-long)  # train-both in growing CPU budgets (BUDGETS, minutes each), both drafters
      # copied at every budget to $RUNS/budget-N/ (the same-budget pair at each point)
      first=1
      for b in ${BUDGETS:-60 120 240 480 960}; do
        if [ -f "$RUNS/budget-$b/done" ]; then first=0; continue; fi
        if [ $first = 1 ] && [ ! -d "$ORTHRUS_RUN/checkpoint" ]; then
          CPU_MINUTES=$b RESUME= stage train-both
        else
          CPU_MINUTES=$b RESUME=1 stage train-both
        fi
        first=0
        for run in "$ORTHRUS_RUN" "$EAGLE3_RUN"; do
          mkdir -p "$RUNS/budget-$b/$(basename "$run")"
          find "$run" -maxdepth 1 -type f -exec cp {} "$RUNS/budget-$b/$(basename "$run")/" \;
        done
        touch "$RUNS/budget-$b/done"
      done ;;
    curve)  # Orthrus acceptance vs training tokens, on held-out answers
      $PY -m benchmarks acceptance-curve --base "$BASE" --run "$ORTHRUS_RUN" \
          --data "$RUNS/heldout-smollm2-256" --max-rows 12 --max-anchors 64 --threads 2 \
          --out "$OUT/curve" ;;
    accept)  # vLLM's own acceptance per draft position at K = 7 for a heads folder (HEADS,
      # default the Orthrus run) on 12 held-out prompts: what every recipe change is judged on
      # (ACCEPT_BASELINES / EAGLE3: more baselines in the same run, as accept-both sets)
      heads=${HEADS:-$ORTHRUS_RUN}; name=$(basename "$heads"); mkdir -p "$RUNS/accept"
      $PY -c "from diffspec.model_executors.reference.orthrus import materialize_orthrus; \
materialize_orthrus('$BASE', '$heads', '$RUNS/accept/$name-ckpt')"
      OMP_NUM_THREADS=1 $PY -m benchmarks driver --model "$RUNS/accept/$name-ckpt" --dataset jsonl \
          --data-path "$RUNS/heldout.jsonl" --num-prompts 12 --chat --max-tokens 128 \
          --max-model-len 2048 --engines vllm --baselines "${ACCEPT_BASELINES:-ar,orthrus:7}" \
          ${EAGLE3:+--eagle3-drafter "$EAGLE3"} --concurrency 1 --threads 1 \
          --out "${ACCEPT_OUT:-$RUNS/accept/$name}" ;;
    ship-eagle3)  # the EAGLE-3 run's drafter in bf16 (29 MB), where the tables find it
      $PY -c "from training.eagle3 import write_bf16_copy; write_bf16_copy('$EAGLE3_RUN', '$EAGLE3_SHIPPED')" ;;
    accept-both)  # both drafters in one vLLM run: the Orthrus heads (HEADS, default the
      # shipped ones) at K = 7 and EAGLE-3 (EAGLE3, default the shipped one) at K = 3 and 7
      HEADS=${HEADS:-$HEADS_SHIPPED} EAGLE3=${EAGLE3:-$EAGLE3_SHIPPED} \
      ACCEPT_BASELINES=ar,orthrus:7,eagle3:3,eagle3:7 ACCEPT_OUT=${ACCEPT_OUT:-$RUNS/accept/both} \
          stage accept ;;
    curves)  # both drafters' training curves on one CPU-minute axis, vLLM-measured points
      # (MEASURED: extra --measured arguments, e.g. from accept-both's report)
      $PY -m benchmarks drafter-curves \
          --run "orthrus=$HEADS_SHIPPED/training-2026-11-24.json,$HEADS_SHIPPED/training.json" \
          --run "eagle3=${EAGLE3:-$EAGLE3_SHIPPED}/training.json" ${MEASURED:-} \
          --out "${CURVES_OUT:-$RUNS/curves}" ;;
    profile)  # this machine's forward latency for the block-size recommendation
      $PY -m benchmarks profile-forward --model "$BASE" --query-lens 1,2,3,4,5,6,7,8 \
          --contexts 256 --repeats 10 --stat min --threads 2 --out "$OUT/profile" ;;
    compare)  # the Orthrus checkpoint (base + heads), then AR / ngram / EAGLE-3 / Orthrus
      $PY -c "from diffspec.model_executors.reference.orthrus import materialize_orthrus; \
materialize_orthrus('$BASE', '$ORTHRUS_RUN', '$ORTHRUS_RUN-ckpt')"
      # held-out split: the K sweep (the best K found there is used on GSM8K / HumanEval)
      $PY -m benchmarks driver --model "$ORTHRUS_RUN-ckpt" --dataset jsonl \
          --data-path "$RUNS/heldout.jsonl" --num-prompts 12 --chat --max-tokens 128 \
          --max-model-len 2048 --engines vllm \
          --baselines ar,ngram:4,eagle3:1,eagle3:3,orthrus:2,orthrus:3,orthrus:7 \
          --eagle3-drafter "$EAGLE3_RUN" --concurrency 1,4 \
          --profile "$OUT/profile/forward_latency.json" --out "$OUT/sharegpt-heldout"
      for ds in gsm8k humaneval; do
        $PY -m benchmarks driver --model "$ORTHRUS_RUN-ckpt" --dataset "$ds" \
            --num-prompts 8 --chat --max-tokens 128 --max-model-len 2048 --engines vllm \
            --baselines "${BASELINES:-ar,ngram:4,eagle3:3,orthrus:3}" \
            --eagle3-drafter "$EAGLE3_RUN" --concurrency 1,4 \
            --profile "$OUT/profile/forward_latency.json" --out "$OUT/$ds"
      done
      $PY -m benchmarks compare --reports "$OUT"/{sharegpt-heldout,gsm8k,humaneval}/report.json \
          --curve "orthrus=$ORTHRUS_RUN/training.json" \
          --curve "eagle3=$EAGLE3_RUN/training.json" --out "$OUT" ;;
    bench-serve)  # the same baselines through vLLM's own benchmark client
      $PY -m benchmarks bench-serve --model "$ORTHRUS_RUN-ckpt" \
          --prompts "$RUNS/heldout.jsonl" --baselines "${BASELINES:-ar,eagle3:3,orthrus:3}" \
          --eagle3-drafter "$EAGLE3_RUN" --concurrency 1,4 --num-prompts 8 \
          --output-len 128 --out "$OUT/bench-serve" ;;
    *) echo "unknown stage $1 (data pack heldout train-eagle3 train-orthrus train-both train-long curve accept ship-eagle3 accept-both curves profile compare bench-serve ablation)" >&2; exit 2 ;;
  esac
}

[ $# -ge 1 ] || { sed -n 2,13p "$0"; exit 2; }
for s in "$@"; do stage "$s"; done
