#!/usr/bin/env bash
# One call of a lent machine (the device tool) spent on its host CPU alone, the GPU left idle: the CPU
# measurements of issue 18 on the lent machines' host CPUs, with nothing else running, so that memory bandwidth
# and caches belong to the measured pair of cores (sessions/gpu_session.sh measures the CPU beside GPU work, which shares
# them):
#   1. the machine (CPU model and flags, C library, versions) -> $OUT/machine.txt
#   2. the fused kernel alone (forward and backward of a training step, maps out of cache) at N = 512, batch 2
#      and N = 128, batch 8, and the memory bandwidth of the pair of cores (--kernel) -> $OUT/cpu_kernel.log:
#      the kernel's own time on this host, and how fast the maps can stream (a kernel change is timed against
#      the default build by adding --kernel-build=FLAGS, calls alternating)
#   3. the paired timing of attention_cpu.py (eager, sdpa and EA alternating, 2 threads pinned to two physical
#      cores): N = 512 training in three processes, as the full benchmark's three rounds, then (after step 5)
#      N = 128 training -> $OUT/cpu_paired.log (one BENCH_RESULT line a process). N = 512 inference is left out
#      for time.
#   4. N = 512 training once more with glibc's heap held (no trimming, no mmap: every variant's steps then touch
#      no fresh pages), which takes the page faults out of the ratio -> $OUT/cpu_paired_held_heap.log
#   5. where eager's and EA's N = 512 training steps go, per operator (--profile) -> $OUT/cpu_profile.log
# Each step has its own time limit; the paired processes time 40 s (N = 512) and 30 s (N = 128) after 2 warm-up
# rounds, and the profile runs before the held heap, so that the whole script fits the call's limit. The device
# machine has torch and transformers but not ea_hf: it runs from the working tree.
#     device run: bash bench/sessions/cpu_host_session.sh   (timeout_s 570)
# `bash bench/sessions/cpu_host_session.sh quick` runs steps 1, 2 at N = 512 only (the kernel's own time is what a kernel
# change moves first) and 3's three N = 512 training processes (30 s of timed steps each): for a session with
# less device time left.
#     device run: bash bench/sessions/cpu_host_session.sh quick   (timeout_s 360)
# `bash bench/sessions/cpu_host_session.sh dropout` runs the same three processes with BERT's own dropout (0.1, attention
# and hidden; the targets are measured without), into cpu_paired_dropout.log: what EA costs users who fine-tune.
#     device run: bash bench/sessions/cpu_host_session.sh dropout   (timeout_s 300)
set -u
MODE=${1:-full}
DROPOUT=0
PAIRED_LOG=cpu_paired.log
if [ "$MODE" = dropout ]; then
    DROPOUT=0.1
    PAIRED_LOG=cpu_paired_dropout.log
fi
SHORT=no
[ "$MODE" = quick ] || [ "$MODE" = dropout ] && SHORT=yes
OUT=${OUT:-/tmp/cpu_host_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EA_HF_CACHE=/tmp/ea_hf_cache CUDA_VISIBLE_DEVICES=
PYTHON=${PYTHON:-python3}

# Two CPUs on different physical cores, the last ones.
PAIR=$(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | cut -d, -f1 | tail -2 | paste -sd,)
{
    date -u
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|MHz|L2|L3"
    grep -m1 -o -w -E "avx[0-9a-z_]*|amx[0-9a-z_]*|fma" /proc/cpuinfo | sort -u | paste -sd" "
    ldd --version | head -1
    $PYTHON -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    echo "measured on CPUs $PAIR"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# The kernel is built (about half a minute) before any timing starts.
taskset -c "$PAIR" $PYTHON -c "from ea_hf.ops.cpu import binding; print('CPU kernel built:', binding.kernel_available())"
# The kernel alone first: short, and what the paired steps cannot separate.
KERNEL_CASES=("512 2" "128 8")
[ "$SHORT" = yes ] && KERNEL_CASES=("512 2")
[ "$MODE" = dropout ] && KERNEL_CASES=()
for case in ${KERNEL_CASES[@]+"${KERNEL_CASES[@]}"}; do
    set -- $case
    timeout 90 taskset -c "$PAIR" $PYTHON bench/benchmarks/attention_cpu.py --kernel "$1" --batch "$2" --threads 2 \
        --repeats 9 >> "$OUT/cpu_kernel.log" 2>&1
    echo "kernel N=$1: exit $?"
done

paired() {  # N MODE BATCH SECONDS LOG
    timeout $(($4 + 120)) taskset -c "$PAIR" $PYTHON bench/benchmarks/attention_cpu.py --paired "$1" "$2" --batch "$3" \
        --threads 2 --rounds 1 --paired-seconds "$4" --warmup 2 --dropout "$DROPOUT" >> "$OUT/$5" 2>&1
    echo "paired N=$1 $2 ($5): exit $?"
}
SECONDS_512=40
[ "$SHORT" = yes ] && SECONDS_512=30
for _ in 1 2 3; do paired 512 training 2 $SECONDS_512 "$PAIRED_LOG"; done
if [ "$SHORT" = yes ]; then
    grep -c '^BENCH_RESULT' "$OUT/$PAIRED_LOG"
    exit 0
fi
timeout 90 taskset -c "$PAIR" $PYTHON bench/benchmarks/attention_cpu.py --profile 512 training --batch 2 --threads 2 \
    --warmup 2 --repeats 2 > "$OUT/cpu_profile.log" 2>&1
echo "profile: exit $?"
paired 128 training 8 30 cpu_paired.log
GLIBC_TUNABLES=glibc.malloc.trim_threshold=68719476736:glibc.malloc.mmap_max=0 \
    paired 512 training 2 40 cpu_paired_held_heap.log
grep -c '^BENCH_RESULT' "$OUT/cpu_paired.log" "$OUT/cpu_paired_held_heap.log" "$OUT/cpu_profile.log" \
    "$OUT/cpu_kernel.log"
