#!/usr/bin/env bash
# One call of a lent GPU machine (the device tool), prepared here so that a short lease is spent on measuring:
#   1. the machine (CPU model, GPU, versions) -> $OUT/machine.txt
#   2. the CUDA half of tests/ops/test_triton_{kernel,attention}.py (compiled Triton kernels) -> $OUT/cuda_tests.*
#   3. bench_gpu.py, bf16 then fp32 at N = 512 (batch 8), without the compiled variant -> $OUT/model/
#   4. bench_gpu.py, bf16 training at N = 2048 (batch 2) -> $OUT/model_2048/
#   5. bench_triton_kernels.py --liger: the evolution step beside Liger-Kernel's Multi-Token Attention, bf16,
#      N = 512, batch 8 (where bench/wheels holds the liger-kernel wheel) -> $OUT/liger/
#   6. bench_decoder.py --device cuda: the ~125M Llama's prefill, its memory and decoding, bf16 -> $OUT/decoder/
#   7. with the time the steps above left (they end early when nothing hangs), bench_gpu.py's ea-triton-compile
#      (inductor; the Triton kernels and the fused tail as operators) beside eager, bf16
#      training at N = 512 -> $OUT/model_compiled/
#   8. meanwhile, on four other cores, CUDA hidden: the paired CPU timing of bench_attention.py (eager, sdpa, EA
#      alternating, 2 threads) at the issue-18 cases, and the step memory of eager and EA training, so that each
#      lease also records the CPU ratios on its host's CPU model -> $OUT/cpu_paired.log, $OUT/cpu_memory.log
# In that order of priority. Each step has its own time limit, so that a slow one leaves the others their share;
# the whole script ends within about 480 s. The device machine has torch, transformers and triton but not ea_hf
# (it runs from the working tree) and no network: run bench/fetch_wheels.sh here first and carry bench/wheels.
#     device run: bash bench/gpu_session.sh   (timeout_s 510, carry ["bench/wheels"])
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT/model" "$OUT/model_2048" "$OUT/liger" "$OUT/decoder" "$OUT/model_compiled"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EA_HF_CACHE=/tmp/ea_hf_cache TOKENIZERS_PARALLELISM=false
PYTHON=${PYTHON:-python3}

{
    date -u
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Flags" | cut -c1-200
    nvidia-smi -L
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv
    $PYTHON -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    command -v g++ c++ || echo "no C++ compiler"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# Two pairs of CPUs on different physical cores, the last ones: the CPU timing on one, the CPU step memory (not
# disturbed by a neighbour, unlike time) on the other; the GPU work gets the rest. The CPU runs hide the GPU
# (bench_attention.py runs on CUDA where it sees one).
CORES=$(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | cut -d, -f1)
CPU_PAIR=$(tail -2 <<< "$CORES" | paste -sd,)
MEMORY_PAIR=$(tail -4 <<< "$CORES" | head -2 | paste -sd,)
OTHER_CPUS=$(lscpu -p=CPU | grep -v '^#' | grep -vxF -f <(tr , '\n' <<< "$CPU_PAIR,$MEMORY_PAIR") | paste -sd,)
OTHER_CPUS=${OTHER_CPUS:-$CPU_PAIR}
echo "CPU timing on CPUs $CPU_PAIR, CPU memory on $MEMORY_PAIR; GPU work on $OTHER_CPUS"
CUDA_VISIBLE_DEVICES= taskset -c "$CPU_PAIR" $PYTHON -c "from ea_hf.ops import cpu; print('CPU kernel built:',
cpu.kernel_available())"
(
    for case in "512 training 2 60" "512 inference 2 45" "128 training 8 45"; do
        set -- $case
        CUDA_VISIBLE_DEVICES= timeout 130 taskset -c "$CPU_PAIR" $PYTHON bench/bench_attention.py --paired "$1" \
            "$2" --batch "$3" --threads 2 --rounds 1 --paired-seconds "$4" --warmup 2
    done
) > "$OUT/cpu_paired.log" 2>&1 &
CPU_JOB=$!
(
    for case in "eager 512 2" "ea 512 2" "eager 128 8" "ea 128 8"; do
        set -- $case
        CUDA_VISIBLE_DEVICES= timeout 90 taskset -c "$MEMORY_PAIR" $PYTHON bench/bench_attention.py --case "$1" \
            "$2" training --batch "$3" --threads 2 --repeats 2 --warmup 1
    done
) > "$OUT/cpu_memory.log" 2>&1 &
MEMORY_JOB=$!

on_gpu_cpus() { taskset -c "$OTHER_CPUS" "$@"; }
on_gpu_cpus timeout 130 $PYTHON -m pytest -q -p no:cacheprovider -rs tests/ops/test_triton_kernel.py \
    tests/ops/test_triton_attention.py -k cuda \
    --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
echo "CUDA tests: exit $?"; tail -5 "$OUT/cuda_tests.log"
on_gpu_cpus timeout 170 $PYTHON bench/bench_gpu.py --cases 512:8 --dtypes bf16 fp32 \
    --variants eager sdpa ea-torch ea-triton --out "$OUT/model" > "$OUT/model/log.txt" 2>&1
echo "model bench: exit $?"; tail -30 "$OUT/model/log.txt"
on_gpu_cpus timeout 55 $PYTHON bench/bench_gpu.py --cases 2048:2 --dtypes bf16 --modes training --no-check \
    --variants eager sdpa ea-torch ea-triton --out "$OUT/model_2048" > "$OUT/model_2048/log.txt" 2>&1
echo "model bench N=2048: exit $?"; tail -12 "$OUT/model_2048/log.txt"
LIGER_WHEEL=$(ls bench/wheels/liger_kernel-*.whl 2>/dev/null | head -1)
if [ -n "$LIGER_WHEEL" ]; then
    $PYTHON -m pip install --no-deps --no-index --quiet --target /tmp/liger "$LIGER_WHEEL" \
        || $PYTHON -m zipfile -e "$LIGER_WHEEL" /tmp/liger
    PYTHONPATH=$PWD:/tmp/liger on_gpu_cpus timeout 55 $PYTHON bench/bench_triton_kernels.py --liger --dtypes bf16 \
        --cases 512:8 --out "$OUT/liger" > "$OUT/liger/log.txt" 2>&1
    echo "Liger bench: exit $?"; grep -i "liger" "$OUT/liger/log.txt" | tail -5
else
    echo "no liger-kernel wheel in bench/wheels (run bench/fetch_wheels.sh here, carry bench/wheels): Liger skipped"
fi
on_gpu_cpus timeout 70 $PYTHON bench/bench_decoder.py --device cuda --paired-rounds 3 --decode-tokens 16 \
    --threads 4 --out "$OUT/decoder" > "$OUT/decoder/log.txt" 2>&1
echo "decoder bench: exit $?"; tail -15 "$OUT/decoder/log.txt"
LEFT=$((465 - SECONDS))  # the whole script within about 480 s: the compiled cases get what is left
if [ "$LEFT" -gt 40 ]; then
    on_gpu_cpus timeout "$LEFT" $PYTHON bench/bench_gpu.py --cases 512:8 --dtypes bf16 --modes training --no-check \
        --variants eager ea-triton-compile --out "$OUT/model_compiled" > "$OUT/model_compiled/log.txt" 2>&1
    echo "compiled bench ($LEFT s left): exit $?"; tail -8 "$OUT/model_compiled/log.txt"
else
    echo "compiled bench skipped: $LEFT s left"
fi
wait "$CPU_JOB" "$MEMORY_JOB"
grep -v '^BENCH_RESULT' "$OUT/cpu_paired.log" | tail -5
grep -c '^BENCH_RESULT' "$OUT/cpu_paired.log" "$OUT/cpu_memory.log"
