#!/usr/bin/env bash
# One call of a lent GPU machine (the device tool), prepared here so that a short lease is spent on measuring. The
# steps, in order of priority, each with its own time limit and its own folder of partial results, so that a slow or
# failing step leaves the others their time:
#   a. smoke: every Triton kernel compiled on the GPU and checked against torch (the CUDA half of
#      tests/ops/triton/test_{evolution,attention_tail}.py)                                            -> a_smoke/
#   b. the decision table, BERT-Base: eager, sdpa and the candidates for the default on CUDA (ea-torch, ea-triton,
#      ea-torch-nhwc) on bf16 and fp32 training and inference at N = 512 (batch 8), bf16 training at N = 2048
#      (batch 2); then eager, ea-compile and ea-triton-compile on bf16 training at N = 512. Each case's bytes are
#      counted (bench/harness/bytes.py, on the meta device) beside its time, and their quotient is its achieved
#      bandwidth; the report names the default per precision by the rule (attention_gpu.default_choice: the fastest
#      correct candidate), and the session's reports are merged into the GPU's decision table. The byte table of every case of issue 72 (bytes_per_step.py) is counted meanwhile on the CPU, in
#      the background                                                                                  -> b_table/
#   c. the Triton tiles tuned on this GPU: every setting of the sweep timed and checked against torch operations,
#      the fastest correct ones written into the tuned-tile table (commit c_tune/tuned_tiles.json as
#      ea_hf/ops/triton/tuned_tiles.json); the cases' achieved bandwidth on the least bytes          -> c_tune/
#   d. each kernel's bandwidth measured by Nsight Compute (`ncu --clock-control none`) where the machine has it;
#      otherwise step c's bytes over time stand                                                       -> d_bandwidth/
#   e. the decoder, a ~125M Llama in bf16: fast generation first (a static cache; sdpa and EA decoding as they
#      are and compiled with mode="reduce-overhead", against the targets), then the prefill, its memory and
#      decoding of eager, sdpa and EA with the dynamic cache                                         -> e_decoder/
#   f. the evolution step beside Liger-Kernel's Multi-Token Attention (where bench/wheels holds its wheel) -> f_liger/
# Meanwhile, on four cores of their own with CUDA hidden, the paired CPU timing and step memory of attention_cpu.py
# (cpu/), and on the GPU steps' cores the byte table (b_table/bytes/). Everything comes back as one file, $OUT/gpu_session.tgz, beside this script's log (session.log). The steps'
# limits add up to 595 s, more than the lease's 510: a run cut short leaves the folders of the steps it finished
# under $OUT, untarred, and the last steps (f, then e's dynamic cache) are the ones cut. The device machine has torch, transformers and triton but not ea_hf (it runs from the working
# tree) and no network: run bench/sessions/fetch_wheels.sh here first and carry bench/wheels.
#     device run: bash bench/sessions/gpu_session.sh   (timeout_s 510, carry ["bench/wheels"])
# DRY_RUN=1 runs every step's CPU dry run instead (Triton's interpreter, tiny models): what CI runs
# (tests/bench/sessions/test_sessions.py), so that a lease is never spent on a step that cannot start.
set -u
OUT=${OUT:-/tmp/gpu_session}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EA_HF_CACHE=/tmp/ea_hf_cache TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
STEPS=(a_smoke b_table c_tune d_bandwidth e_decoder f_liger cpu)
for step in "${STEPS[@]}"; do mkdir -p "$OUT/$step"; done

# step NAME LIMIT COMMAND...: COMMAND under `timeout LIMIT`, its output in NAME/log.txt, its exit status in
# NAME/status.txt and on the log. The dry run's limits are three times the GPU's: they bound a lent GPU's minutes,
# and the dry run's interpreted kernels on CI's shared cores took 44 s of step c's 50 at a load of 3.5.
step() {
    local name=$1 limit=$2
    [ "$DRY_RUN" = 1 ] && limit=$((limit * 3))
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >> "$OUT/$name/log.txt" 2>&1
    local status=$?
    echo "$status" >> "$OUT/$name/status.txt"
    echo "step $name: exit $status after $((SECONDS - start)) s (limit $limit s)"
    tail -4 "$OUT/$name/log.txt"
}
# The GPU flavour of a benchmark's arguments, or the dry run's: gpu_or_dry "GPU ARGS" "DRY ARGS".
gpu_or_dry() { if [ "$DRY_RUN" = 1 ]; then echo "$2"; else echo "$1"; fi; }

{
    date -u
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core" | cut -c1-200
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>/dev/null
    $PYTHON -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
    command -v ncu || echo "no ncu"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# The CPU runs on the last two pairs of physical cores (not on a dry run: CI's CPU is small), the GPU work on the rest.
CORES=$(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | cut -d, -f1)
CPU_PAIR=$(tail -2 <<< "$CORES" | paste -sd,)
MEMORY_PAIR=$(tail -4 <<< "$CORES" | head -2 | paste -sd,)
OTHER_CPUS=$(lscpu -p=CPU | grep -v '^#' | grep -vxF -f <(tr , '\n' <<< "$CPU_PAIR,$MEMORY_PAIR") | paste -sd,)
OTHER_CPUS=${OTHER_CPUS:-$CPU_PAIR}
CPU_JOBS=()
if [ "$DRY_RUN" != 1 ]; then
    (
        for case in "512 training 2 60" "512 inference 2 45" "128 training 8 45"; do
            set -- $case
            CUDA_VISIBLE_DEVICES= timeout 130 taskset -c "$CPU_PAIR" $PYTHON bench/benchmarks/attention_cpu.py --paired "$1" \
                "$2" --batch "$3" --threads 2 --rounds 1 --paired-seconds "$4" --warmup 2
        done
    ) > "$OUT/cpu/paired.log" 2>&1 &
    CPU_JOBS+=($!)
    (
        for case in "eager 512 2" "ea 512 2" "eager 128 8" "ea 128 8"; do
            set -- $case
            CUDA_VISIBLE_DEVICES= timeout 90 taskset -c "$MEMORY_PAIR" $PYTHON bench/benchmarks/attention_cpu.py --case "$1" \
                "$2" training --batch "$3" --threads 2 --repeats 2 --warmup 1
        done
    ) > "$OUT/cpu/memory.log" 2>&1 &
    CPU_JOBS+=($!)
fi
ON_GPU_CPUS=(taskset -c "$OTHER_CPUS")  # the prefix of the GPU steps' commands
[ "$DRY_RUN" = 1 ] && ON_GPU_CPUS=()
# The byte table (no GPU: the meta device): in the background on a GPU run; a step of its own on a dry run, below.
BYTES=(bench/benchmarks/bytes_per_step.py --out "$OUT/b_table/bytes")
if [ "$DRY_RUN" != 1 ]; then
    (
        CUDA_VISIBLE_DEVICES= timeout 150 taskset -c "$OTHER_CPUS" $PYTHON "${BYTES[@]}"
        echo "$?" > "$OUT/b_table/bytes_status.txt"
    ) > "$OUT/b_table/bytes.log" 2>&1 &
    CPU_JOBS+=($!)
fi

# a. smoke
step a_smoke 50 "${ON_GPU_CPUS[@]}" $PYTHON -m pytest -q -p no:cacheprovider -rs -x --junitxml="$OUT/a_smoke/tests.xml" \
    $(gpu_or_dry "tests/ops/triton/test_evolution.py tests/ops/triton/test_attention_tail.py -k cuda" \
        "tests/ops/triton/test_compilation.py -k configuration_lists")

# b. the decision table
DRY=$(gpu_or_dry "" "--dry-run --repeats 1 --warmup 1")
# (The dry run's variants: one of each kind, on the CPU's budget; the channels-last candidate's check, not Triton's.)
step b_table 175 "${ON_GPU_CPUS[@]}" $PYTHON bench/benchmarks/attention_gpu.py $DRY $(gpu_or_dry \
    "--cases 512:8 --dtypes bf16 fp32 --variants eager sdpa ea-torch ea-triton ea-torch-nhwc" \
    "--cases 16:2 --variants eager ea-torch ea-torch-nhwc") --out "$OUT/b_table/512"
step b_table 55 "${ON_GPU_CPUS[@]}" $PYTHON bench/benchmarks/attention_gpu.py $DRY $(gpu_or_dry \
    "--cases 2048:2 --dtypes bf16 --variants eager sdpa ea-torch ea-triton ea-torch-nhwc" \
    "--cases 24:2 --variants eager ea-triton") --modes training --no-check --out "$OUT/b_table/2048"
step b_table 70 "${ON_GPU_CPUS[@]}" $PYTHON bench/benchmarks/attention_gpu.py $DRY $(gpu_or_dry \
    "--cases 512:8 --dtypes bf16 --variants eager ea-compile ea-triton-compile" "--cases 16:2 --variants ea-compile") \
    --modes training --no-check --out "$OUT/b_table/compiled"
# The GPU's decision table (the candidates' cases and checks, the verdict per precision): commit it as
# bench/results/<gpu>/decision_table.json, and ea_hf.ops.triton.common.TRITON_BY_DEFAULT with it.
step b_table 15 $PYTHON bench/benchmarks/attention_gpu.py --decision-table "$OUT/b_table/decision_table.json" \
    "$OUT"/b_table/512/*.json "$OUT"/b_table/2048/*.json
[ "$DRY_RUN" = 1 ] && step b_table 60 $PYTHON "${BYTES[@]}" --cases "bert training 64 1" --variants eager ea-torch \
    ea-torch-nhwc

# c. tiles tuned on this GPU, and the bandwidth each case achieved
step c_tune 50 "${ON_GPU_CPUS[@]}" $PYTHON bench/benchmarks/triton_kernels.py --tune "$OUT/c_tune/tuned_tiles.json" \
    $(gpu_or_dry "--dtypes bf16 fp32 --cases 512:8 --repeats 10" "--dry-run --repeats 1") --out "$OUT/c_tune"

# d. bandwidth by Nsight Compute, where the machine has it
if [ "$DRY_RUN" != 1 ] && command -v ncu > /dev/null; then
    step d_bandwidth 25 "${ON_GPU_CPUS[@]}" ncu --clock-control none --target-processes all --kernel-name regex:_kernel \
        --launch-skip 6 --launch-count 6 --metrics dram__bytes.sum,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        $PYTHON bench/benchmarks/triton_kernels.py --dtypes bf16 --cases 512:8 --repeats 1 --warmup 1 \
        --out "$OUT/d_bandwidth"
else
    echo "no ncu here (or a dry run): the achieved bandwidth is step c's bytes over time" | tee "$OUT/d_bandwidth/log.txt"
fi

# e. the decoder: compiled static-cache decoding (two inductor compiles), then the dynamic cache's paired timing
step e_decoder 90 "${ON_GPU_CPUS[@]}" $PYTHON bench/benchmarks/decoder_static.py --attentions sdpa ea $(gpu_or_dry \
    "--device cuda --lengths 512 --paired-rounds 3 --decode-tokens 32 --threads 4" \
    "--device cpu --tiny --compile-backend eager --lengths 16 --paired-rounds 1 --decode-tokens 2") \
    --out "$OUT/e_decoder"
step e_decoder 40 "${ON_GPU_CPUS[@]}" $PYTHON bench/benchmarks/decoder_gpu.py $(gpu_or_dry \
    "--device cuda --paired-rounds 3 --decode-tokens 16 --threads 4" \
    "--device cpu --tiny --lengths 16 --paired-rounds 1 --decode-tokens 2") \
    --out "$OUT/e_decoder"

# f. Liger-Kernel
LIGER_WHEEL=$(ls bench/wheels/liger_kernel-*.whl 2>/dev/null | head -1)
if [ -n "$LIGER_WHEEL" ] && [ "$DRY_RUN" != 1 ]; then
    $PYTHON -m pip install --no-deps --no-index --quiet --target /tmp/liger "$LIGER_WHEEL" \
        || $PYTHON -m zipfile -e "$LIGER_WHEEL" /tmp/liger
    PYTHONPATH=$PWD:/tmp/liger step f_liger 25 "${ON_GPU_CPUS[@]}" $PYTHON bench/benchmarks/triton_kernels.py --liger \
        --dtypes bf16 --cases 512:8 --out "$OUT/f_liger"
else
    echo "Liger skipped: no liger-kernel wheel in bench/wheels (run bench/sessions/fetch_wheels.sh here, carry bench/wheels)," \
        "or a dry run" | tee "$OUT/f_liger/log.txt"
fi

[ ${#CPU_JOBS[@]} -gt 0 ] && wait "${CPU_JOBS[@]}"
echo "session: $SECONDS s"
tar czf "$OUT/gpu_session.tgz" -C "$OUT" machine.txt "${STEPS[@]}" && rm -rf "${STEPS[@]/#/$OUT/}" "$OUT/machine.txt"
ls -la "$OUT"
