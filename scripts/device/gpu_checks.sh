#!/usr/bin/env bash
# Device-machine checks, by stage, so one 10-minute call can take several:
#   OUT=dir bash scripts/device/gpu_checks.sh env suite reference kernels train bench
# `acceptance` is tests/gpu: the reference, overlap, scaling (2+ GPUs) and capacity checks with their thresholds.
# Stages are named by what they measure. Carry .whl (../shared/tools/device_wheels.sh --with-deepspeed) for the stages
# that need Hydra or DeepSpeed, and another source tree as _baseline for `baseline_gpt1b`, `house_gpt1b`, `launch_bound`.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: a stage may run in another directory
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 ZOFF_CACHE_DIR=/tmp/zoff_cache
DEPS=""
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  DEPS=/tmp/site:
fi
export PYTHONPATH=$DEPS$PWD  # the scripts import the lightning_zoff of the tree they run in
h100_cap() {  # bench.py's argument capping a GPU larger than an H100 at its 79.2 GiB (the plan reads the cap): none on one
  python3 -c "import torch; t = torch.cuda.get_device_properties(0).total_memory / 2**30; print('--gpu-memory-gb 79.2' if t > 80 else '')"
}
per_step() {  # FILE: each step's time and the telemetry that moves the exposed update, from a bench JSON's first run
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; t=r.get('telemetry_steps') or {}
print('steps', [round(x, 2) for x in r.get('steps', [])])
for k in ('zoff/exposed_optimizer_s', 'zoff/first_forward_s', 'zoff/forward_s', 'zoff/cpu_update_s', 'zoff/lent_units', 'zoff/between_s', 'zoff/landing_wait_s'):
    print(k, [None if x is None else round(x, 3) for x in t.get(k, [])])" "$1"
}
# MegaTrain's configuration measures from its third step: its first step places the state (the GPU idles 1.5-2 s while
# the host's update finishes), so the second step's first forward waits for no update (exposed 0.15-0.35 s a step
# against 1.35-1.64 s in every later one: files 2026-12-07_h100x1_session2{5,6}_*megatrain*), a step that flatters
MEGATRAIN_WARMUP=2
megatrain_short() {  # NAME OPTION LIMIT_S: MegaTrain's configuration with one zoff option, 3 measured steps after 2,
  # into $OUT/NAME.json within LIMIT_S; prints the table's zoff line after the option
  timeout $3 python3 scripts/bench/bench.py --config megatrain_qwen25_7b --runs zoff --warmup $MEGATRAIN_WARMUP --steps 3 \
      $(h100_cap) \
      --zoff-option "$2" --run-timeout-s $(( $3 - 5 )) --out "$OUT/$1.json" 2>&1 | grep -v "^INFO" \
      | grep -E "^ +zoff " | sed "s/^/$2: /"
}
gpt13b_side() {  # SIDE NAME LIMIT_S BENCH_ARGS...: the 13B GPT at batch 4 in SIDE's tree (_baseline or .) into $OUT/NAME.json,
  # within LIMIT_S and what is left of $SPEED_BUDGET (default 585 s) since the script began; printed after NAME
  local side=$1 name=$2 limit=$3; shift 3
  local left=$(( ${SPEED_BUDGET:-585} - SECONDS )); [ $left -lt $limit ] && limit=$left
  [ $limit -lt 100 ] && { echo "$name: not run, $left s left" | tee -a "$OUT/speed_47.txt"; return; }
  (cd $side && PYTHONPATH=$DEPS$PWD timeout $limit python3 scripts/bench/bench.py --model gpt13b --batch 4 --warmup 2 \
      --runs zoff --run-timeout-s $(( limit - 5 )) "$@" --out "$OUT/$name.json" 2>&1 | grep -v "^INFO" | tail -2 \
      | sed "s/^/$name: /" | tee -a "$OUT/speed_47.txt")
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) { nvidia-smi -L; nproc; cat /sys/kernel/mm/transparent_hugepage/enabled; lscpu | grep -i numa; lscpu | grep -E "Model name|Flags" | cut -c1-300; free -g | head -2
           python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; } 2>&1 | tee "$OUT/env.txt" ;;
    acceptance)  # tests/gpu, after the kernels' JIT build (a fresh machine's first minute, timed apart); each test's
      # outcome is written as it ends, so a call cut by its limit still says how far it got. $ACCEPTANCE_TESTS picks
      # files (default all of tests/gpu; two calls: ACCEPTANCE_TESTS="tests/gpu/test_check_capacity.py
      # tests/gpu/test_check_overlap.py tests/gpu/test_check_placement.py", then the others by -k or by name)
      s=$SECONDS; timeout 240 python3 -c "from lightning_zoff.ops import build; build.load()" 2>&1 | tail -2
      echo "kernels built or loaded in $(( SECONDS - s )) s" | tee "$OUT/acceptance.txt"
      ZOFF_TEST_TIMES="$OUT/acceptance_times.txt" timeout ${ACCEPTANCE_TIMEOUT:-580} python3 -m pytest -v -p no:cacheprovider --durations=30 ${ACCEPTANCE_TESTS:-tests/gpu} \
          2>&1 | grep --line-buffered -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E |s (call|setup)" | tee -a "$OUT/acceptance.txt" ;;
    suite) timeout 200 python3 -m pytest -q -x tests/test_kernels.py tests/test_optim.py tests/test_training.py 2>&1 | tail -6 | tee "$OUT/pytest.txt" ;;
    kquick) timeout 120 python3 -m pytest -q -x tests/test_kernels.py -k "bf16_moments or agree or into" 2>&1 | tail -3 | tee "$OUT/kernels_quick.txt" ;;
    reference) timeout 150 python3 scripts/checks/check_reference.py --steps 30 --out "$OUT/reference_check.json" 2>&1 | grep -v "^INFO\|Tip\|available:" | tail -40 | tee "$OUT/reference_check.txt" ;;
    reference_lent)  # every host unit's update run by the GPU (lending), against the same fp32 CPU reference
      timeout 150 python3 scripts/checks/check_reference.py --steps 30 --option accelerator_state="'none'" \
          --option accelerator_update_share=1.0 --out "$OUT/reference_check_lent.json" 2>&1 | grep -v "^INFO\|Tip\|available:" | tail -12 | tee "$OUT/reference_check_lent.txt" ;;
    kernels) timeout 240 python3 scripts/bench/bench_kernels.py --params 500e6 --out "$OUT/kernels.json" 2>&1 | grep -v "^INFO" | tail -25 | tee "$OUT/kernels.txt" ;;
    train) timeout 150 python3 scripts/train.py trainer.max_steps=60 hydra.run.dir=/tmp/train_run 2>&1 | grep -v "^INFO" | tail -25 | tee "$OUT/train.txt"; cp /tmp/train_run/loss.png "$OUT/" 2>/dev/null ;;
    overlap) timeout 200 python3 scripts/checks/check_overlap.py --steps 12 --out "$OUT/overlap_check.json" 2>&1 | grep -v "^INFO\|Tip\|available:" | tail -30 | tee "$OUT/overlap_check.txt" ;;
    bench) timeout 330 python3 scripts/bench/bench.py --runs gpu_only zoff --accumulate 1 4 --steps 6 --warmup 2 --out "$OUT/bench.json" 2>&1 | tail -12 | tee "$OUT/bench.txt" ;;
    bench_acc1) timeout ${BENCH_TIMEOUT:-380} python3 scripts/bench/bench.py --runs gpu_only zoff deepspeed_zero3_offload --accumulate 1 --steps 6 --warmup 2 --out "$OUT/bench_acc1.json" 2>&1 | grep -v "^INFO" | tail -40 | tee "$OUT/bench_acc1.txt" ;;
    bench_acc4) timeout ${BENCH_TIMEOUT:-540} python3 scripts/bench/bench.py --runs gpu_only zoff zoff_accum_gpu zoff_accum_gpu_retained deepspeed_zero3_offload --accumulate 4 --steps 5 --warmup 2 --out "$OUT/bench_acc4.json" 2>&1 | grep -v "^INFO" | tail -40 | tee "$OUT/bench_acc4.txt" ;;
    scaling) timeout 300 python3 scripts/checks/check_scaling.py --devices 2 --steps 20 --out "$OUT/scaling_check.json" 2>&1 | grep -v "^INFO" | tail -40 | tee "$OUT/scaling_check.txt" ;;
    bench_2gpu) timeout ${BENCH2_TIMEOUT:-540} python3 scripts/bench/bench.py --devices 2 --runs gpu_only zoff deepspeed_zero3_offload --accumulate 1 4 --steps 5 --warmup 2 --out "$OUT/bench_2gpu.json" 2>&1 | grep -v "^INFO" | tail -40 | tee "$OUT/bench_2gpu.txt" ;;
    bench_1of2) CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-200} taskset -c 0-$(( $(nproc) / 2 - 1 )) python3 scripts/bench/bench.py --runs zoff --accumulate 4 --steps 5 --warmup 2 --out "$OUT/bench_1of2.json" 2>&1 | grep -v "^INFO" | tail -20 | tee "$OUT/bench_1of2.txt" ;;
    bench_4gpu) timeout ${BENCH4_TIMEOUT:-400} python3 scripts/bench/bench.py --devices 4 --runs zoff deepspeed_zero3_offload --accumulate 1 --steps 5 --warmup 2 --out "$OUT/bench_4gpu_acc1.json" 2>&1 | grep -v "^INFO" | tail -12 | tee "$OUT/bench_4gpu_acc1.txt"
                timeout ${BENCH4_TIMEOUT:-400} python3 scripts/bench/bench.py --devices 4 --runs zoff --accumulate 4 --steps 5 --warmup 2 --out "$OUT/bench_4gpu_acc4.json" 2>&1 | grep -v "^INFO" | tail -12 | tee "$OUT/bench_4gpu_acc4.txt" ;;
    bench_8gpu) timeout ${BENCH8_TIMEOUT:-400} python3 scripts/bench/bench.py --devices 8 --runs zoff deepspeed_zero3_offload --accumulate 1 --steps 5 --warmup 2 --out "$OUT/bench_8gpu_acc1.json" 2>&1 | grep -v "^INFO" | tail -12 | tee "$OUT/bench_8gpu_acc1.txt"
                timeout ${BENCH8_TIMEOUT:-400} python3 scripts/bench/bench.py --devices 8 --runs zoff --accumulate 4 --steps 5 --warmup 2 --out "$OUT/bench_8gpu_acc4.json" 2>&1 | grep -v "^INFO" | tail -12 | tee "$OUT/bench_8gpu_acc4.txt" ;;
    capacity_8gpu)  # the largest GPT (gpt30b, 32.3B) on the 8-GPU machine's 560 GB host, with bf16 moments and no overlap
      timeout ${CAPACITY_TIMEOUT:-560} python3 scripts/checks/check_capacity.py --model gpt30b --devices 8 --steps 20 --batch 4 \
          --option "optimizer_state_dtype='bf16'" --option overlap=False --out "$OUT/capacity_gpt30b.json" 2>&1 \
          | grep -v "^INFO" | tail -26 | tee "$OUT/capacity_gpt30b.txt" ;;
    bench_2of4) CUDA_VISIBLE_DEVICES=0,1 timeout ${BENCH_TIMEOUT:-200} taskset -c 0-$(( $(nproc) / 2 - 1 )) python3 scripts/bench/bench.py --devices 2 --runs zoff --accumulate 4 --steps 5 --warmup 2 --out "$OUT/bench_2of4.json" 2>&1 | grep -v "^INFO" | tail -12 | tee "$OUT/bench_2of4.txt" ;;
    capacity)  # the 1x H200 box (128 GB host): Qwen3-4B's shape next to DeepSpeed, then the 7B GPT, then bf16 moments
      q="python3 scripts/bench/bench.py --model qwen3_4b --accumulate 1 --steps 4 --warmup 1"
      timeout 150 $q --runs zoff_sync --out "$OUT/qwen3_4b_zoff_sync.json" 2>&1 | grep -v "^INFO" | tail -4 | tee "$OUT/qwen3_4b.txt"
      timeout 220 $q --runs deepspeed_zero3_offload --out "$OUT/qwen3_4b_deepspeed.json" 2>&1 | grep -v "^INFO" | tail -4 | tee -a "$OUT/qwen3_4b.txt"
      timeout 200 python3 scripts/checks/check_capacity.py --model gpt7b --steps 20 --batch 4 --option "optimizer_state_dtype='bf16'" \
          --option overlap=False --out "$OUT/capacity_gpt7b.json" 2>&1 | grep -v "^INFO" | tail -26 | tee "$OUT/capacity_gpt7b.txt"
      left=$(( ${CAPACITY_BUDGET:-560} - SECONDS ))
      [ $left -gt 60 ] && timeout $left $q --runs zoff_bf16_moments --out "$OUT/qwen3_4b_zoff_bf16_moments.json" 2>&1 | grep -v "^INFO" | tail -4 | tee -a "$OUT/qwen3_4b.txt"
      left=$(( ${CAPACITY_BUDGET:-560} - SECONDS ))
      [ $left -gt 60 ] && timeout $left python3 scripts/bench/bench.py --runs zoff_bf16_moments zoff --accumulate 1 --steps 5 --warmup 2 --out "$OUT/gpt1b_zoff_bf16_moments.json" 2>&1 | grep -v "^INFO" | tail -4 | tee "$OUT/gpt1b_bf16_moments.txt" ;;
    fsdp2_internals)  # the CPU (gloo) tests that lean on FSDP2 internals, under the GPU machine's torch
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_unused_params.py tests/test_overlap.py tests/test_compat.py 2>&1 | tail -4 | tee "$OUT/fsdp2_internals.txt" ;;
    baseline_gpt1b)  # the 1.34B GPT's zoff and zoff_host_only in another tree, then in this one, on the same machine
      # (carry the other tree as _baseline, from `mkdir _baseline && git archive REV | tar -x -C _baseline`)
      [ -d _baseline/lightning_zoff ] || { echo "baseline_gpt1b: carry another source tree as _baseline"; exit 1; }
      for side in _baseline .; do
        label=$( [ $side = . ] && echo this || echo baseline )
        bench=scripts/bench/bench.py; [ -f $side/$bench ] || bench=scripts/bench.py  # a tree from before scripts/bench/
        (cd $side && PYTHONPATH=$DEPS$PWD timeout 280 python3 $bench --runs zoff zoff_host_only --accumulate 1 --steps 6 \
            --warmup 2 --out "$OUT/bench_gpt1b_$label.json" 2>&1 | grep -v "^INFO" | tail -5 | tee -a "$OUT/baseline_gpt1b.txt")
      done ;;
    alloc_retries)  # issue 46 items 3 and 1: the allocator's retries named by cause, and the steps' own peak by site
      # against the plan's traced step (ZOFF_BENCH_ALLOC_HISTORY, zoffbench/alloc_history.py) on Llama-3-8B b1 seq 4096
      # (one retry a step, the step counted 5.5 GB over the held on 1x H200), 6 steps; needs .whl
      ZOFF_BENCH_ALLOC_HISTORY=1 timeout 300 python3 scripts/bench/bench.py --model llama3_8b --batch 1 --seq 4096 \
          --num-workers 4 --accumulate 1 --steps 6 --warmup 2 --runs zoff --run-timeout-s 280 \
          --out "$OUT/alloc_retries_llama3_8b_b1.json" 2>&1 | grep -v "^INFO" | tail -4 | tee "$OUT/alloc_retries.txt"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print(json.dumps({k: r.get(k) for k in
          ('gpu_alloc_retries_per_step', 'gpu_reserved_by_stream', 'gpu_alloc_retry_causes', 'gpu_step_peak')}
          | {'plan_step_gb': (r.get('memory') or {}).get('accelerator_step', 0) / 1e9}, indent=1)[:9000])" \
          "$OUT/alloc_retries_llama3_8b_b1.json" | tee -a "$OUT/alloc_retries.txt" ;;
    alloc_retries_gpt13b)  # issue 46 items 1 and 3 on find_largest's model: the 13B GPT at batch 4, accumulate 1 and
      # 4 (14 and 82 retries a step at 8ffd96f), 6 steps each, the retries named and the steps' own peak by site
      for acc in 1 4; do
        ZOFF_BENCH_ALLOC_HISTORY=1 timeout 270 python3 scripts/bench/bench.py --model gpt13b --batch 4 --accumulate $acc \
            --steps 6 --warmup 2 --runs zoff --run-timeout-s 260 --out "$OUT/alloc_retries_gpt13b_acc$acc.json" 2>&1 \
            | grep -v "^INFO" | tail -3 | tee -a "$OUT/alloc_retries_gpt13b.txt"
        python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print(json.dumps({k: r.get(k) for k in
            ('peak_gpu_gb', 'peak_gpu_reserved_gb', 'gpu_alloc_retries_per_step', 'gpu_reserved_by_stream', 'gpu_step_peak')}
            | {k + '_gb': v / 1e9 for k, v in (r.get('memory') or {}).items() if k.startswith('accelerator_') and v > 1e6},
            indent=1)[:4000])" "$OUT/alloc_retries_gpt13b_acc$acc.json" | tee -a "$OUT/alloc_retries_gpt13b.txt"
      done ;;
    house_gpt1b)  # issue 45: gpt1b batch 8 in another tree (carried as _baseline) and in this one, one call: the
      # refactor moved no time; GPU-only training in this tree beside them
      [ -d _baseline/lightning_zoff ] || { echo "house_gpt1b: carry another source tree as _baseline"; exit 1; }
      for side in _baseline .; do
        label=$( [ $side = . ] && echo this || echo baseline ); runs=$( [ $side = . ] && echo "zoff gpu_only" || echo zoff )
        (cd $side && PYTHONPATH=$DEPS$PWD timeout 250 python3 scripts/bench/bench.py --model gpt1b --batch 8 --runs $runs \
            --accumulate 1 --steps 10 --warmup 3 --out "$OUT/house_gpt1b_b8_$label.json" 2>&1 | grep -v "^INFO" | tail -5 | tee -a "$OUT/house_gpt1b.txt")
      done ;;
    launch_bound)  # gpt1b at batch 1, where the host's launches bound zoff's step (0.61-0.71x GPU-only, 2026-12-07):
      # zoff in another tree (carried as _baseline) and in this one, GPU-only in this one; one call, 12 steps each
      [ -d _baseline/lightning_zoff ] || { echo "launch_bound: carry another source tree as _baseline"; exit 1; }
      for side in _baseline .; do
        label=$( [ $side = . ] && echo this || echo baseline ); runs=$( [ $side = . ] && echo "zoff gpu_only" || echo zoff )
        (cd $side && PYTHONPATH=$DEPS$PWD timeout 200 python3 scripts/bench/bench.py --model gpt1b --batch 1 --runs $runs \
            --accumulate 1 --steps 12 --warmup 3 --out "$OUT/launch_bound_gpt1b_b1_$label.json" 2>&1 | grep -v "^INFO" \
            | tail -5 | tee -a "$OUT/launch_bound.txt")
      done ;;
    placement) timeout 300 python3 scripts/checks/check_placement.py --steps 12 --out "$OUT/placement_check.json" 2>&1 | grep -v "^INFO\|Tip\|available:" | tail -30 | tee "$OUT/placement_check.txt" ;;
    gpt1b_vs_deepspeed)  # gpt1b batch 8 at accumulate 1 and 4 against DeepSpeed's stronger configurations
      timeout ${BENCH_TIMEOUT:-560} python3 scripts/bench/bench.py --model gpt1b --batch 8 --accumulate 1 4 --steps 6 --warmup 2 --runs gpu_only zoff deepspeed_zero2_offload deepspeed_zero3_offload_ratio --out "$OUT/gpt1b_vs_deepspeed.json" 2>&1 | grep -v "^INFO" | tail -16 | tee "$OUT/gpt1b_vs_deepspeed.txt" ;;
    host_overlap)  # the overlapped engine against the synchronous one, all state on the host: gpt7b fp32 moments, qwen3_4b (clipped every step), gpt1b acc 4 next to GPU-only
      timeout 300 python3 scripts/bench/bench.py --model gpt7b --batch 4 --accumulate 1 --steps 5 --warmup 2 --runs zoff_host_only zoff_sync --out "$OUT/host_overlap_gpt7b.json" 2>&1 | grep -v "^INFO" | tail -6 | tee "$OUT/host_overlap.txt"
      timeout 150 python3 scripts/bench/bench.py --model qwen3_4b --accumulate 1 --steps 5 --warmup 2 --runs zoff_host_only zoff_sync --out "$OUT/host_overlap_qwen3_4b.json" 2>&1 | grep -v "^INFO" | tail -6 | tee -a "$OUT/host_overlap.txt"
      timeout 150 python3 scripts/bench/bench.py --model gpt1b --accumulate 4 --steps 5 --warmup 2 --runs gpu_only zoff_host_only --out "$OUT/host_overlap_gpt1b_acc4.json" 2>&1 | grep -v "^INFO" | tail -6 | tee -a "$OUT/host_overlap.txt" ;;
    finetune7b)  # a fine-tune of the 7B shape's last 2 blocks: host state for those only
      timeout 240 python3 scripts/checks/check_capacity.py --model gpt7b --train-last 2 --steps 8 --batch 4 \
          --out "$OUT/finetune_gpt7b_last2.json" 2>&1 | grep -v "^INFO" | tail -12 | tee "$OUT/finetune_gpt7b.txt" ;;
    mainjob_qwen)  # the main job on Qwen3-4B's shape completes; peak host RSS of the whole job
      timeout 330 python3 scripts/bench/peak_rss.py --out "$OUT/mainjob_qwen3_4b_rss.json" -- python3 scripts/train.py \
          model=hf_qwen3_4b data=synthetic trainer.max_steps=6 hydra.run.dir=$PWD/outputs/run_qwen 2>&1 | grep -v "^INFO" | tail -30 | tee "$OUT/mainjob_qwen3_4b.txt"
      cp outputs/run_qwen/loss.png "$OUT/mainjob_qwen3_4b_loss.png" 2>/dev/null; ls -a outputs/run_qwen outputs/run_qwen/checkpoints; du -sh outputs/run_qwen | tee -a "$OUT/mainjob_qwen3_4b.txt"; rm -rf outputs/run_qwen ;;
    mainjob_7b)  # the 7B GPT with the options of its config's comment (12 B/param on the 128 GB host)
      timeout 400 python3 scripts/bench/peak_rss.py --out "$OUT/mainjob_gpt_7b_rss.json" -- python3 scripts/train.py \
          model=gpt_7b data=synthetic trainer.max_steps=6 hydra.run.dir=$PWD/outputs/run_7b 2>&1 | grep -v "^INFO" | tail -30 | tee "$OUT/mainjob_gpt_7b.txt"
      cp outputs/run_7b/loss.png "$OUT/mainjob_gpt_7b_loss.png" 2>/dev/null; ls -a outputs/run_7b outputs/run_7b/checkpoints; du -sh outputs/run_7b | tee -a "$OUT/mainjob_gpt_7b.txt"; rm -rf outputs/run_7b ;;
    smoke_offload)  # quick: the host path with checkpointed activations, and "auto" moving the 1.34B GPT's state to the GPU
      timeout 200 python3 scripts/bench/bench.py --model gpt1b --batch 8 --accumulate 1 --steps 3 --warmup 2 --runs zoff_host_only --activation-checkpointing --out "$OUT/smoke_host.json" 2>&1 | grep -v "^INFO" | tail -4 | tee "$OUT/smoke.txt"
      timeout 200 python3 scripts/bench/bench.py --model gpt1b --batch 8 --accumulate 1 --steps 3 --warmup 2 --runs zoff --out "$OUT/smoke_auto.json" 2>&1 | grep -v "^INFO" | tail -4 | tee -a "$OUT/smoke.txt"
      grep -q "failed" "$OUT/smoke.txt" && { echo "smoke failed: stopping"; exit 1; } ;;
    gpt13b_zoff)  # the 13B GPT at batch 4 with default options
      timeout ${BENCH_TIMEOUT:-400} python3 scripts/bench/bench.py --model gpt13b --batch 4 --accumulate 1 --steps 20 --warmup 2 --runs zoff --out "$OUT/gpt13b_zoff.json" 2>&1 | grep -v "^INFO" | tail -6 | tee "$OUT/gpt13b_zoff.txt" ;;
    gpt13b_speed)  # the 13B GPT at batch 4, default options: 20 steps at accumulate 1, 10 at accumulate 4
      b="python3 scripts/bench/bench.py --model gpt13b --batch 4 --warmup 2 --runs zoff --run-timeout-s 280"
      timeout 300 $b --accumulate 1 --steps 20 --out "$OUT/gpt13b_b4_zoff.json" 2>&1 | grep -v "^INFO" | tail -3 | tee "$OUT/gpt13b_speed.txt"
      timeout 300 $b --accumulate 4 --steps 10 --out "$OUT/gpt13b_b4_zoff_acc4.json" 2>&1 | grep -v "^INFO" | tail -3 | tee -a "$OUT/gpt13b_speed.txt" ;;
    speed_first)  # one call's worth of the speed runs, most wanted first: 13B default (20 steps), 13B acc 4, 64 layers bf16
      b="python3 scripts/bench/bench.py --model gpt13b --batch 4 --warmup 2 --runs zoff"
      timeout 210 $b --accumulate 1 --steps 20 --run-timeout-s 200 --out "$OUT/gpt13b_b4_zoff.json" 2>&1 | grep -v "^INFO" | tail -2 | tee "$OUT/speed_first.txt"
      timeout 190 $b --accumulate 4 --steps 10 --run-timeout-s 180 --out "$OUT/gpt13b_b4_zoff_acc4.json" 2>&1 | grep -v "^INFO" | tail -2 | tee -a "$OUT/speed_first.txt"
      left=$(( ${SPEED_BUDGET:-580} - SECONDS ))
      [ $left -gt 120 ] && timeout $left $b --accumulate 1 --steps 10 --layers 64 --run-timeout-s $((left - 5)) --zoff-option "optimizer_state_dtype='bf16'" --out "$OUT/gpt_64l_b4_zoff_bf16_moments.json" 2>&1 | grep -v "^INFO" | tail -2 | tee -a "$OUT/speed_first.txt" ;;
    speed_47a)  # issue 47 on 1x H200, beside the tree it was filed at (carry 8ffd96f as _baseline): the 13B GPT clipped
      # every step, 20 measured steps in each tree, then bf16 moments in this one
      [ -d _baseline/lightning_zoff ] || { echo "speed_47a: carry another source tree as _baseline"; exit 1; }
      gpt13b_side _baseline gpt13b_b4_fp32_baseline 195 --accumulate 1 --steps 20
      gpt13b_side . gpt13b_b4_fp32_this 195 --accumulate 1 --steps 20
      gpt13b_side . gpt13b_b4_bf16_moments_this 180 --accumulate 1 --steps 10 --zoff-option "optimizer_state_dtype='bf16'" ;;
    speed_47b)  # issue 47: unclipped (the clip-rare step) in this tree, then 4 accumulated micro-batches in both
      [ -d _baseline/lightning_zoff ] || { echo "speed_47b: carry another source tree as _baseline"; exit 1; }
      gpt13b_side . gpt13b_b4_unclipped_this 170 --accumulate 1 --steps 10 --clip none
      gpt13b_side _baseline gpt13b_b4_acc4_baseline 200 --accumulate 4 --steps 8
      gpt13b_side . gpt13b_b4_acc4_this 200 --accumulate 4 --steps 8 ;;
    speed_47c)  # issue 47: the largest sizes of 2026-12-02 in this tree, 10 measured steps: 47 layers fp32, 64 bf16 moments
      gpt13b_side . gpt_47l_b4_fp32_this 230 --accumulate 1 --steps 10 --layers 47
      gpt13b_side . gpt_64l_b4_bf16_moments_this 340 --accumulate 1 --steps 10 --layers 64 --zoff-option "optimizer_state_dtype='bf16'" ;;
    gpt13b_variants)  # the 13B GPT with bf16 moments, and without clipping (speculation can be kept)
      b="python3 scripts/bench/bench.py --model gpt13b --batch 4 --accumulate 1 --warmup 2 --steps 10 --runs zoff --run-timeout-s 250"
      timeout 270 $b --zoff-option "optimizer_state_dtype='bf16'" --out "$OUT/gpt13b_b4_zoff_bf16_moments.json" 2>&1 | grep -v "^INFO" | tail -3 | tee "$OUT/gpt13b_variants.txt"
      timeout 270 $b --clip none --out "$OUT/gpt13b_b4_zoff_unclipped.json" 2>&1 | grep -v "^INFO" | tail -3 | tee -a "$OUT/gpt13b_variants.txt" ;;
    largest_speed)  # the largest sizes of 2026-12-02 at 10 measured steps: 47 layers fp32 moments, 64 layers bf16
      b="python3 scripts/bench/bench.py --model gpt13b --batch 4 --accumulate 1 --warmup 2 --steps 10 --runs zoff --run-timeout-s 280"
      timeout 290 $b --layers 64 --zoff-option "optimizer_state_dtype='bf16'" --out "$OUT/gpt_64l_b4_zoff_bf16_moments.json" 2>&1 | grep -v "^INFO" | tail -3 | tee "$OUT/largest_speed.txt"
      timeout 290 $b --layers 47 --out "$OUT/gpt_47l_b4_zoff.json" 2>&1 | grep -v "^INFO" | tail -3 | tee -a "$OUT/largest_speed.txt" ;;
    gpt13b_deepspeed)  # DeepSpeed's attempts at the 13B GPT, in the same bench's terms
      timeout ${BENCH_TIMEOUT:-560} python3 scripts/bench/bench.py --model gpt13b --batch 4 --accumulate 1 --steps 20 --warmup 2 --runs deepspeed_zero3_offload deepspeed_zero3_offload_ratio --ratios 0.5 --run-timeout-s 240 --out "$OUT/gpt13b_deepspeed.json" 2>&1 | grep -v "^INFO" | tail -6 | tee "$OUT/gpt13b_deepspeed.txt" ;;
    gpt13b_options)  # a fraction of the state on the GPU, and bf16 moments: trains or refused before allocating
      for option in "accelerator_state=0.4" "optimizer_state_dtype='bf16'"; do
        timeout 300 python3 scripts/bench/bench.py --model gpt13b --batch 4 --accumulate 1 --steps 3 --warmup 1 --runs zoff --zoff-option "$option" --out "$OUT/gpt13b_$(echo $option | tr -dc 'a-z0-9.').json" 2>&1 | grep -v "^INFO" | tail -3 | tee -a "$OUT/gpt13b_options.txt"
      done ;;
    largest)  # the largest GPT of the gpt13b width that trains 5 steps: predicted by the plan, then tried
      timeout ${LARGEST_TIMEOUT:-580} python3 scripts/checks/find_largest.py --runs ${LARGEST_RUNS:-zoff zoff_bf16_moments} --run-timeout-s 300 --out "$OUT/largest.json" 2>&1 | grep -v "^INFO" | tail -12 | tee "$OUT/largest.txt" ;;
    gpt7b_24gb)  # a 24 GB GPU's budget: the 7B GPT at batch 1, zoff and DeepSpeed
      timeout ${BENCH_TIMEOUT:-560} python3 scripts/bench/bench.py --model gpt7b --batch 1 --accumulate 1 --steps 4 --warmup 2 --gpu-memory-gb 24 --runs zoff deepspeed_zero3_offload --run-timeout-s 250 --out "$OUT/gpt7b_24gb.json" 2>&1 | grep -v "^INFO" | tail -8 | tee "$OUT/gpt7b_24gb.txt" ;;
    no_regression)  # where the model fits the GPU: zoff next to GPU-only training
      timeout 330 python3 scripts/bench/bench.py --model gpt7b --batch 4 --accumulate 1 --steps 5 --warmup 2 --runs gpu_only zoff --out "$OUT/gpt7b_b4.json" 2>&1 | grep -v "^INFO" | tail -6 | tee "$OUT/no_regression.txt"
      timeout 200 python3 scripts/bench/bench.py --model gpt1b --batch 8 --accumulate 1 --steps 6 --warmup 2 --runs gpu_only zoff --out "$OUT/gpt1b_b8.json" 2>&1 | grep -v "^INFO" | tail -6 | tee -a "$OUT/no_regression.txt" ;;
    reshard_kept)  # gpt1b at batch 8 and 1: GPU-only, zoff, and zoff with each unit gathered from its forward to its
      # backward (reshard_after_forward=False: no all-gather in backward; on the 2-core box FSDP2's host time a step
      # fell by a third); whether "auto" should choose it where the plan has room
      for b in 8 1; do
        timeout 200 python3 scripts/bench/bench.py --model gpt1b --batch $b --accumulate 1 --steps 20 --warmup 3 \
            --runs gpu_only zoff --out "$OUT/gpt1b_b${b}.json" 2>&1 | grep -E "^ +(gpu_only|zoff) " | tee -a "$OUT/reshard_kept.txt"
        timeout 100 python3 scripts/bench/bench.py --model gpt1b --batch $b --accumulate 1 --steps 20 --warmup 3 \
            --runs zoff --zoff-option reshard_after_forward=False --out "$OUT/gpt1b_b${b}_kept.json" 2>&1 \
            | grep -E "^ +zoff " | sed "s/^/kept: /" | tee -a "$OUT/reshard_kept.txt"
      done ;;
    fsdp2_cpu_offload)  # FSDP2's own CPU offload next to zoff and the synchronous engine, gpt1b at accumulate 1 and 4
      timeout ${BENCH_TIMEOUT:-400} python3 scripts/bench/bench.py --runs fsdp2_cpu_offload zoff zoff_sync --accumulate 1 4 --steps 5 --warmup 2 --out "$OUT/fsdp2_cpu_offload.json" 2>&1 | grep -v "^INFO" | tail -40 | tee "$OUT/fsdp2_cpu_offload.txt" ;;
    litgpt_1b)  # LitGPT's GPT (Llama-3.2-1B's config, random init) in LitGPT's setup order: zoff, then Fabric's FSDP as
      # LitGPT's pretrain.py sets it up; then zoff with the embedding tied to the head (one FSDP2 unit for both)
      l="python3 scripts/train_litgpt.py --model Llama-3.2-1B --devices 1 --block-size 2048 --micro-batch 4 --max-steps 12 --warmup 3 --log-every 4 --max-bytes 8000000 --out /tmp/litgpt"
      for run in "zoff" "fsdp" "zoff --tie-embeddings"; do
        name=$(echo $run | tr -dc 'a-z_ -' | tr ' -' '__' | sed 's/__*/_/g')
        timeout ${LITGPT_TIMEOUT:-200} $l --strategy $run --json "$OUT/litgpt_llama32_1b_$name.json" 2>&1 | grep -v "^INFO" | tail -3 | tee -a "$OUT/litgpt_1b.txt"
      done ;;
    litgpt_scripts)  # issue 48: LitGPT's own finetune/full.py and lora.py (random weights, a local instruction set),
      # under zoff and LitGPT's own choice ("auto" on one GPU), bf16-mixed, 20 iterations, seq 2048: a 1B-class config
      # (Llama-3.2-1B), then Llama-3-8B full (LitGPT's own: expected out of GPU memory) within the budget. Needs .whl
      # with litgpt and tokenizers (scripts/device/hf_wheels.sh).
      b="python3 scripts/bench/bench_litgpt_scripts.py --seq 2048 --iters 20 --work /tmp/litgpt_bench"
      rm -rf /tmp/litgpt_bench
      timeout 250 $b --model Llama-3.2-1B --run-timeout-s 110 --out "$OUT/litgpt_full_llama32_1b.json" 2>&1 | grep -v "^INFO" | grep -E "^ *(zoff|litgpt|fsdp):|wrote" | tee "$OUT/litgpt_scripts.txt"
      rm -rf /tmp/litgpt_bench
      left=$(( ${LITGPT_BUDGET:-580} - SECONDS ))
      [ $left -gt 120 ] && timeout $left $b --model Llama-3-8B --run-timeout-s $(( (left - 60) / 2 )) --out "$OUT/litgpt_full_llama3_8b.json" 2>&1 | grep -v "^INFO" | grep -E "^ *(zoff|litgpt|fsdp):|wrote" | tee -a "$OUT/litgpt_scripts.txt" ;;
    litgpt_full_8b)  # issue 48: LitGPT's finetune/full.py on Llama-3-8B under zoff alone (it stopped with "unhandled cuda
      # error" at 829ed85; ran at e3a6f47), NCCL's own warnings on, each failed run's output kept in the JSON. Needs .whl
      rm -rf /tmp/litgpt_bench
      NCCL_DEBUG=WARN timeout 560 python3 scripts/bench/bench_litgpt_scripts.py --seq 2048 --iters 20 --work /tmp/litgpt_bench \
          --model Llama-3-8B --strategies zoff --run-timeout-s 400 --out "$OUT/litgpt_full_llama3_8b_zoff.json" 2>&1 \
          | grep -v "^INFO" | grep -E "^ *zoff:|wrote" | tee "$OUT/litgpt_full_8b.txt" ;;
    litgpt_lora)  # issue 48: LitGPT's own finetune/lora.py on Llama-3-8B's config (random weights, a local instruction
      # set), bf16-mixed, seq 2048, 20 iterations, under zoff and LitGPT's own choice; needs .whl with litgpt
      rm -rf /tmp/litgpt_bench
      timeout 585 python3 scripts/bench/bench_litgpt_scripts.py --script lora --model Llama-3-8B --seq 2048 --iters 20 \
          --work /tmp/litgpt_bench --run-timeout-s 250 --out "$OUT/litgpt_lora_llama3_8b.json" 2>&1 | grep -v "^INFO" \
          | grep -E "^ *(zoff|litgpt|fsdp):|wrote" | tee "$OUT/litgpt_lora.txt" ;;
    users_launch)  # what users launch: Llama-3-8B's and Qwen3-14B's shapes at seq 4096, 4 loader workers (needs .whl
      # with transformers and DeepSpeed). Parts in $USERS_PARTS (default all, in this order), $USERS_STEPS measured steps
      # (default 20; 3 for a smoke run), within $USERS_BUDGET seconds (default 585: one device call): a part's runs get
      # its own limit or what is left, so a run the budget cuts is recorded as timed out; a part with < 60 s left is
      # skipped, and says so. At 20 steps all four take about 12 minutes: two calls, USERS_PARTS="llama_b1 llama_b4"
      # then USERS_PARTS="qwen14b deepspeed".
      steps=${USERS_STEPS:-20}
      users() {  # MODEL BATCH STEPS WARMUP RUN_LIMIT_S RUNS...: one bench call, results named by model, batch and runs
        local model=$1 batch=$2 n=$3 warmup=$4 limit=$5; shift 5
        local name="users_${model}_b${batch}_$(echo "$@" | tr ' ' '_')" left=$(( ${USERS_BUDGET:-585} - SECONDS ))
        if [ $left -lt 60 ]; then echo "$name: skipped, $left s left of USERS_BUDGET" | tee -a "$OUT/users_launch.txt"; return; fi
        [ $limit -gt $(( left - 20 )) ] && limit=$(( left - 20 ))
        timeout $left python3 scripts/bench/bench.py --model $model --batch $batch --seq 4096 --num-workers 4 \
            --accumulate 1 --steps $n --warmup $warmup --runs "$@" --run-timeout-s $limit --out "$OUT/$name.json" 2>&1 \
            | grep -v "^INFO" | tail -5 | tee -a "$OUT/users_launch.txt"
      }
      # limits: setup (8B ~80 s, 14B ~140 s) plus every step at a generous bound, plus the exit
      for part in ${USERS_PARTS:-llama_b1 llama_b4 qwen14b deepspeed}; do
        case $part in
          llama_b1) users llama3_8b 1 $steps 2 $(( 150 + (steps + 2) * 6 )) zoff ;;
          llama_b4) users llama3_8b 4 $steps 2 $(( 150 + (steps + 2) * 10 )) zoff ;;
          # the accelerator's share of the host's updates against the host's cores alone, same code, one call
          llama_b1_share) users llama3_8b 1 $steps 2 $(( 150 + (steps + 2) * 6 )) zoff zoff_no_update_share ;;
          qwen14b_share) users qwen3_14b 1 $steps 2 $(( 240 + (steps + 2) * 12 )) zoff_bf16_moments \
                             zoff_bf16_moments_no_update_share ;;
          # fp32 moments: 207 GB of host state, refused at setup by the plan in one line; bf16 moments: 148 GB
          qwen14b) users qwen3_14b 1 $steps 2 $(( 240 + (steps + 2) * 12 )) zoff zoff_bf16_moments ;;
          # DeepSpeedCPUAdam's fp32 state for 8B on a 128 GB host: expected to die of host memory (outcome host_oom)
          deepspeed) users llama3_8b 1 2 1 400 deepspeed_zero3_offload ;;
          *) echo "users_launch: unknown part $part (llama_b1 llama_b4 llama_b1_share qwen14b qwen14b_share deepspeed)" ;;
        esac
      done ;;
    megatrain_zoff)  # issue 53's first figure alone: zoff at MegaTrain's Qwen2.5-7B configuration (4 workers, default
      # options), 5 steps after 2 (the first step's placement pauses the GPU ~1.5-2 s while the host finishes its update,
      # so the next step meets no update: 16.1-16.9 s against 17.0-18.4 after; see MEGATRAIN_WARMUP at the top); on a GPU
      # larger than an H100's 80 GB the allocator is capped at the H100's 79.2 GiB (the plan reads the cap), so the plan
      # chooses as on the H100; the compute is the larger card's
      cap=$(h100_cap)
      timeout 300 python3 scripts/bench/bench.py --config megatrain_qwen25_7b --runs zoff --warmup $MEGATRAIN_WARMUP \
          --steps 5 $cap --run-timeout-s 290 --out "$OUT/megatrain_qwen25_7b_zoff.json" 2>&1 | tee "$OUT/megatrain_zoff.log" \
          | grep -v "^INFO" | tail -6 | tee "$OUT/megatrain_zoff.txt"
      python3 -c "import json,sys; print(*json.load(open(sys.argv[1]))['runs'][0].get('zoff_lines', []), sep='\n')" \
          "$OUT/megatrain_qwen25_7b_zoff.json" | cut -c1-700
      per_step "$OUT/megatrain_qwen25_7b_zoff.json" ;;
    megatrain_recompute)  # issue 53 item 1's curve: MegaTrain's configuration with the recomputed blocks pinned
      # ($MEGATRAIN_BLOCKS, default "15 18 22"; "auto" chose 13 at e3a6f47 and 15 at 7649c47: 17.39 and 17.13 s a
      # step), state placed by "auto" beside each; 3 measured steps after 2 (~100 s setup + ~90 s each run)
      for blocks in ${MEGATRAIN_BLOCKS:-15 18 22}; do
        megatrain_short megatrain_recompute_$blocks "activation_checkpointing_policy=$blocks" 210 \
            | tee -a "$OUT/megatrain_recompute.txt"
        python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; t=r['telemetry_median']; print(
            'blocks', r.get('recomputed_blocks'), 'GPU units', r['memory'].get('accelerator_units'), 'lent',
            t.get('zoff/lent_units'), 'cpu_update_s %.3f between_s %.3f' % (t.get('zoff/cpu_update_s', 0),
            t.get('zoff/between_s', 0)))" "$OUT/megatrain_recompute_$blocks.json" 2>&1 | tail -1 \
            | tee -a "$OUT/megatrain_recompute.txt"
      done ;;
    megatrain_ring)  # issue 53: MegaTrain's configuration with the staging ring at $RING_UNITS units (default "0 3":
      # none, a landing buffer per host unit as before be1d3d6, then the default; RING_UNITS=12 in a second call), 3
      # measured steps after 2 each (setup 64-114 s + ~95 s + exit: up to 220 s; each run gets at most 280 s of what is
      # left of 585): recomputed blocks, the GPU's share of the state, backward's wait for landing room
      for units in ${RING_UNITS:-0 3}; do
        left=$(( 585 - SECONDS )); limit=$(( left < 280 ? left : 280 ))
        if [ $limit -lt 150 ]; then echo "ring $units: skipped, $left s left" | tee -a "$OUT/megatrain_ring.txt"; continue; fi
        megatrain_short megatrain_ring_$units "staging_ring_units=$units" $limit | tee -a "$OUT/megatrain_ring.txt"
        python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; m=r.get('memory') or {}; t=r.get('telemetry_median') or {}
print('ring', sys.argv[2], 'recomputed', r.get('recomputed_blocks'), 'gpu state GB', round(m.get('accelerator_optimizer_state', 0) / 1e9, 2),
      'host staging GB', round(m.get('host_staging', 0) / 1e9, 2), 'landing_wait_s', t.get('zoff/landing_wait_s'),
      'bwd', r.get('backward_s'), 'TFLOP/s', r.get('model_tflops'), 'host copy GB/s', (r.get('host_floor') or {}).get('host_copy_gb_s'))" \
            "$OUT/megatrain_ring_$units.json" $units 2>&1 | tail -1 | tee -a "$OUT/megatrain_ring.txt"
      done ;;
    megatrain_threads)  # does the host's update starve the training thread? MegaTrain's configuration with the update
      # kernels on $MEGATRAIN_THREADS threads (default "16 14": all the cores, then two left to the training thread
      # and the loader), 3 measured steps after 2 each (55-110 s setup + ~90 s); each step's first forward and exposed update
      for threads in ${MEGATRAIN_THREADS:-16 14}; do
        megatrain_short megatrain_threads_$threads "cpu_threads=$threads" 235 | tee -a "$OUT/megatrain_threads.txt"
        per_step "$OUT/megatrain_threads_$threads.json" | tee -a "$OUT/megatrain_threads.txt"
      done ;;
    idle_profile)  # where the GPU idles in a step (zoffbench/gpu_idle.py: ZOFF_BENCH_PROFILE=1 profiles each run's
      # last step, which the profiler slows): gpt1b at batch 1 (2,048 tokens an iteration, as LitGPT's full.py ran 48 ms
      # slower under zoff than LitGPT's own, 2026-12-07) beside GPU-only; then MegaTrain's configuration (0.6 s a step
      # between phases), 2 steps after 1; $IDLE_PARTS picks (default "gpt1b megatrain")
      export ZOFF_BENCH_PROFILE=1
      profiled=()
      for part in ${IDLE_PARTS:-gpt1b megatrain}; do
        case $part in
          gpt1b) file=$OUT/idle_gpt1b_b1.json
                 timeout 200 python3 scripts/bench/bench.py --model gpt1b --batch 1 --accumulate 1 --runs gpu_only zoff \
                     --steps 8 --warmup 3 --run-timeout-s 95 --out "$file" 2>&1 | grep -v "^INFO" \
                     | tail -5 | tee -a "$OUT/idle_profile.txt" ;;
          megatrain) file=$OUT/idle_megatrain.json
                     timeout 330 python3 scripts/bench/bench.py --config megatrain_qwen25_7b --runs zoff --warmup 1 \
                         --steps 2 $(h100_cap) --run-timeout-s 320 --out "$file" 2>&1 \
                         | grep -v "^INFO" | tail -3 | tee -a "$OUT/idle_profile.txt" ;;
          *) echo "idle_profile: unknown part $part (gpt1b megatrain)"; continue ;;
        esac
        profiled+=("$file")
      done
      unset ZOFF_BENCH_PROFILE
      python3 -m zoffbench.gpu_idle "${profiled[@]}" 2>&1 | cut -c1-400 | tee -a "$OUT/idle_profile.txt" ;;
    peers)  # the peers at their own headline configurations (issue 53), each part one bench call and one JSON, every
      # outcome recorded (time, gpu_oom, host_oom, timeout, unsupported). Needs .whl with transformers, DeepSpeed and
      # torchao (device_wheels.sh --with-deepspeed, scripts/device/hf_wheels.sh, scripts/device/torchao_wheels.sh).
      # Parts in $PEERS_PARTS (default gpt1b megatrain), $PEERS_STEPS measured steps (default 5), within $PEERS_BUDGET
      # seconds (default 585: one device call). Each run has its own limit (--run-timeout-s RUN=S: a run past it is
      # recorded as "timeout"), and a part's call is cut at what the budget leaves (the JSON keeps the runs done by
      # then); a part with < 60 s left is skipped, and says so. MegaTrain's configuration takes two calls (each of its
      # runs builds 7.6B parameters first): PEERS_PARTS=megatrain (zoff, DeepSpeed), its JSON committed, then
      # PEERS_PARTS=megatrain_offload PEERS_ADD_TO=that JSON (Lightning's FSDP, FSDP2, torchao), whose JSON holds all.
      steps=${PEERS_STEPS:-5}
      peers() {  # NAME LIMIT_S ARGS...: one bench call within LIMIT_S and what is left of the budget
        local name=$1 limit=$2 left=$(( ${PEERS_BUDGET:-585} - SECONDS )); shift 2
        if [ $left -lt 60 ]; then echo "$name: skipped, $left s left of PEERS_BUDGET" | tee -a "$OUT/peers.txt"; return; fi
        [ $limit -gt $left ] && limit=$left
        timeout $limit python3 scripts/bench/bench.py "$@" --steps $steps --out "$OUT/$name.json" 2>&1 \
            | grep -v "^INFO" | tail -14 | tee -a "$OUT/peers.txt"
      }
      for part in ${PEERS_PARTS:-gpt1b megatrain}; do
        case $part in
          # gpt1b batch 8: FSDP2's CPU offload beside zoff and DeepSpeed ZeRO-3 offload (setup ~30-90 s each)
          gpt1b) peers peers_gpt1b_b8 330 --model gpt1b --batch 8 --accumulate 1 --warmup 2 \
                     --runs zoff deepspeed_zero3_offload fsdp2_cpu_offload --run-timeout-s 110 ;;
          # MegaTrain's Qwen2.5-7B (seq 1024, batch 8 x 18, 4 workers, blocks recomputed): zoff's setup took 55-115 s
          # and its 6 steps ~110 s (session 21b: 222 s in all; session 23 cut at 235 s after its last step); DeepSpeed
          # builds under zero.Init, then its CPU Adam's first update
          megatrain) peers peers_megatrain_qwen25_7b 585 --config megatrain_qwen25_7b --warmup $MEGATRAIN_WARMUP \
                         --runs zoff deepspeed_zero3_offload --run-timeout-s zoff=320 deepspeed_zero3_offload=250
                     per_step "$OUT/peers_megatrain_qwen25_7b.json" 2>&1 ;;
          # the offloads that build the fp32 model on the host first (session 23: not done with it in 80-90 s)
          megatrain_offload) peers peers_megatrain_qwen25_7b_all 585 --config megatrain_qwen25_7b --warmup $MEGATRAIN_WARMUP \
                                 ${PEERS_ADD_TO:+--add-to "$PEERS_ADD_TO"} \
                                 --runs fsdp_cpu_offload fsdp2_cpu_offload torchao_cpu_offload \
                                 --run-timeout-s fsdp_cpu_offload=185 fsdp2_cpu_offload=185 torchao_cpu_offload=185 ;;
          *) echo "peers: unknown part $part (gpt1b megatrain megatrain_offload)" ;;
        esac
      done ;;
    *) echo "unknown stage $stage: see the stages of scripts/device/gpu_checks.sh"; exit 2 ;;
  esac
done
