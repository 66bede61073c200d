// Fused CPU kernels of Evolving Attention's convolution step (ea_hf/ops/cpu/build.py compiles them,
// ea_hf/ops/cpu/binding.py loads them).
//
// Maps are float32, contiguous [B, H, Q, K]; masks are [B, 1, Q, K] (shared by the heads); outside the map
// the convolution reads zeros. The input a map's rows are read from is
//
//     a = x + lerp_weight * (lerp_end - x)     (lerp_end != NULL; else a = x)
//     a = a + addend                           (addend != NULL: ea_backward's second incoming gradient)
//     a = a * gate                             (gate != NULL: the 0/1 ReLU gate of backward, one bit each)
//     a = a * in_keep                          (in_keep != NULL)
//
// ea_correlate computes, per batch b, output head o, row i and column j,
//
//     v = bias[o] + sum_{c, dy, dx} w[o, c, dy, dx] * a[b, c, i + dy + row_shift, j + dx - kc / 2]
//     v = max(v, 0)                            (relu)
//     saved[b, o, i, j] = v > 0                (saved != NULL: the ReLU gate for backward, one bit each)
//     v = v * out_keep[b, ., i, j]             (out_keep != NULL)
//     v = v + blend_coef * blend'[b, o, i, j]  (blend != NULL, mixed with lerp_end like x)
//     out[b, o, i, j] = out_scale * v;  out2[b, o, i, j] = out2_scale * v  (out2 != NULL)
//
// which is the forward step (ReLU, blend with A_in). ea_backward computes, in the same pass over the rows, the
// input gradient (the same correlation with the kernel flipped and transposed, over the ReLU-gated gradient,
// then masked, blended with the incoming gradient and split between S and A_prev: out and out2) and the weight
// and bias gradients, sum over b, i, j of gy[b, o, i, j] * a[b, c, i + dy + row_shift, j + dx - kc / 2] with
// gy = grad * gate. Neither materialises A_in, the gated gradient or the masked input.
//
// The gate is bit-packed: row (b, h, i) has ceil(cols / 16) 16-bit little-endian words, bit j % 16 of word j / 16
// for column j (bits past the last column are 0). A byte a value would read a quarter of the bytes of a float map,
// and selecting by it takes time of its own; a bit a value is an eighth of that memory, and one 16-bit word
// selects a whole vector (a byte, where vectors hold 8 floats). The packed gate takes as long as bytes would.
//
// No torch headers: a plain shared library called through ctypes, which compiles in about a second. Threads
// come from OpenMP, the runtime torch itself uses.

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace {

// Floats a vector: one 512-bit register with AVX-512, one 256-bit register with AVX (two 128-bit halves on SSE or NEON
// targets). With 16 lanes on AVX2 every vector would take two of its 16 registers, which leaves the weight gradient one
// output head a block: backward would take several times as long (docs/performance.md, "Choices in the fused kernels").
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kMaxHeads = 64;      // MAX_HEADS in ea_hf/ops/limits.py
constexpr int kMaxKernelRows = 8;  // MAX_KERNEL_ROWS there
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat load(const float* p) {
    vfloat v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// Zero-filled floats whose first element sits on a 64-byte boundary: vector loads of aligned columns then never
// straddle two cache lines.
struct AlignedFloats {
    std::vector<float> storage;
    float* data = nullptr;
    void assign_zeros(size_t count) {
        storage.assign(count + kLanes, 0.0f);
        const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
        data = storage.data() + ((64 - address % 64) % 64) / sizeof(float);
    }
};

inline float lanes_sum(vfloat v) {
    float values[kLanes], total = 0.0f;
    store(values, v);
    for (int k = 0; k < kLanes; ++k) total += values[k];
    return total;
}

// A vector's bits of a bit-packed gate (see the file comment): the rows' 16-bit words are read and written as
// one word a vector with 16 lanes, as one byte a vector (the word's low, then high byte) with 8.
typedef std::conditional<kLanes == 16, uint16_t, uint8_t>::type GateBits;

// Bytes of a gate row of `cols` columns: one 16-bit word a 16 columns (or fewer, at the end).
inline int gate_row_bytes(int cols) { return 2 * ((cols + 15) / 16); }

// GateBits units in a gate row of `cols` columns.
inline int gate_units(int cols) { return gate_row_bytes(cols) / static_cast<int>(sizeof(GateBits)); }

// The bits of the vector at column `j` of gate row `row` (the flat row index (b * heads + h) * rows + i).
inline size_t gate_unit(size_t row, int cols, int j) { return row * gate_units(cols) + j / kLanes; }

// Makes the compiler keep `v` in a register (it may not fold its load into each use as a memory operand). A
// vfloat fits one register with AVX-512 or AVX; elsewhere (two halves) this does nothing: an operand wider
// than a register is an impossible asm constraint, and the kernel would not compile at all.
inline void in_register(vfloat& v) {
#if defined(__AVX__)
    __asm__("" : "+v"(v));
#else
    (void)v;
#endif
}

// Bit k set where lane k of `v` is positive.
inline GateBits positive_lanes(vfloat v) {
#if defined(__AVX512F__)
    __m512 m;
    std::memcpy(&m, &v, sizeof m);
    return static_cast<uint16_t>(_mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_GT_OQ));
#else
    unsigned bits = 0;
    for (int k = 0; k < kLanes; ++k) bits |= static_cast<unsigned>(v[k] > 0.0f) << k;
    return static_cast<GateBits>(bits);
#endif
}

// `v` where the bits of `bits` are set, else 0.
inline vfloat select_lanes(GateBits bits, vfloat v) {
#if defined(__AVX512F__)
    __m512 m;
    std::memcpy(&m, &v, sizeof m);
    m = _mm512_maskz_mov_ps(static_cast<__mmask16>(bits), m);
    std::memcpy(&v, &m, sizeof v);
    return v;
#else
    typedef int vint __attribute__((vector_size(kLanes * sizeof(int))));
    vint lane_bits;
    for (int k = 0; k < kLanes; ++k) lane_bits[k] = 1 << k;
    return ((static_cast<int>(bits) & lane_bits) != 0) ? v : vfloat{};
#endif
}

struct Input {  // where rows of `a` come from
    const float* x;
    const float* lerp_end;
    float lerp_weight;
    const float* addend;
    const GateBits* gate;  // bit-packed (see the file comment)
    const float* in_keep;
    int batch, heads, rows, cols, kernel_rows, kernel_cols, row_shift;
    // Per flat row (b * rows + r), where the row's masked tail starts (see RowPlan::columns): an input row is
    // read up to there (it is zero after masking from there on), an output row correlated up to there. NULL: no
    // tails.
    const int* columns = nullptr;
    // Per flat output row, 1 where its correlation is its bias alone (see RowPlan::bias_only). NULL: none.
    const unsigned char* bias_only = nullptr;
};

// Requested cache lines go to L2, not L1 (__builtin_prefetch's locality 2: prefetcht1). At N = 512 the requests of one
// output row for the next come to about 100 KB in backward (S, A_prev, the gradient and the addend of 12 heads), twice
// an L1 data cache: requested into L1 they would evict the rings the blocks compute from before their own use, and
// backward's requests can then cost more than they save (docs/performance.md, "Choices in the fused kernels").
// -DEA_HF_PREFETCH_LOCALITY=3 builds the requests into L1, for bench/benchmarks/attention_cpu.py --kernel-build to compare.
#ifndef EA_HF_PREFETCH_LOCALITY
#define EA_HF_PREFETCH_LOCALITY 2
#endif
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, EA_HF_PREFETCH_LOCALITY); }

// Cache lines of the input rows the next output row will prepare, to be requested a few at a time while the current row
// computes (the forward pass), which is faster with the maps out of cache than requesting a head's lines as its current
// row is prepared. Backward is better off with the latter: its two rings request their lines at once after each
// preparation (docs/performance.md, "Choices in the fused kernels").
struct PrefetchQueue {
    static constexpr int kMaxStreams = 4 * kMaxHeads;
    const char* starts[kMaxStreams];
    size_t lines[kMaxStreams];
    int streams = 0, stream = 0;
    size_t line = 0, pending = 0;

    void add(const void* p, size_t bytes) {
        if (streams == kMaxStreams) return;  // (only hints: the first row of many heads and kernel rows may lose some)
        starts[streams] = static_cast<const char*>(p);
        lines[streams++] = (bytes + 63) / 64;
        pending += (bytes + 63) / 64;
    }
    // Requests the next `count` lines (all that are left at most).
    void issue(size_t count) {
        for (count = std::min(count, pending); count > 0; --count, --pending) {
            prefetch_line(starts[stream] + 64 * line);
            if (++line == lines[stream]) {
                line = 0;
                ++stream;
            }
        }
    }
    // Requests whatever is left, then starts a new list.
    void restart() {
        issue(pending);
        streams = stream = 0;
        line = 0;
    }
};

// The input rows that output rows read, prepared (mixed, gated, masked) with zero borders so that every
// vector load is in bounds: a ring of `kernel_rows` slots per head. Consecutive output rows share all but one
// input row, so each input row is prepared once per thread.
struct RowRing {
    AlignedFloats data;
    std::vector<long> tags;  // which (batch, row) each slot holds; -1 empty, -2 the zero row outside the map
    int width = 0;
    const float* lines[kMaxHeads * kMaxKernelRows];  // [c][dy] -> column 0 of that row, 64-byte aligned
    // With `keep_plain`: the same rows before the gate and the mask (`plain_data` when either applies, else the
    // rows above): the blend's A_in (forward) or incoming gradient (backward), read by the epilogue from here.
    AlignedFloats plain_data;
    const float* plain[kMaxHeads * kMaxKernelRows];
    PrefetchQueue deferred;  // with prepare_rows' `defer_prefetch`: the lines of the next output row's input rows
    // With prepare_rows' `Split`: each prepared row split into its even and odd columns (see split_columns),
    // `pair_stride` floats each, and where the evens of input row dy of head c start.
    AlignedFloats split;
    int pair_stride = 0;
    const float* evens_of[kMaxHeads * kMaxKernelRows];
};

// Each ring row: a zero border of one vector (at least kernel_cols / 2 columns) on the left, so that column 0
// is aligned, then the columns rounded up to whole vectors, then a zero border for the last vector's reads.
constexpr int kLead = 16;  // MAX_KERNEL_COLUMNS / 2 in ea_hf/ops/limits.py; 64 bytes, so column 0 stays aligned
static_assert(kLead % kLanes == 0, "column 0 of a ring row starts a vector");

inline int padded_width(const Input& in) {
    return kLead + ((in.cols + kLanes - 1) / kLanes) * kLanes + std::max(2 * kLanes, kLead);
}

// Copies of input rows that other threads overwrite when the output replaces the input (ea_correlate with
// out == x): the rows just outside a thread's own rows that its first and last output rows read.
struct Halo {
    std::vector<long> rows;  // flat (batch * rows + row) indices
    std::vector<float> data;  // [row][head][column]

    const float* find(long flat, int c, int cols, int heads) const {
        for (size_t k = 0; k < rows.size(); ++k)
            if (rows[k] == flat) return data.data() + (k * heads + c) * static_cast<size_t>(cols);
        return nullptr;
    }

    void capture(const Input& in, long begin, long end) {
        const size_t map = static_cast<size_t>(in.rows) * in.cols;
        auto visit = [&](long t) {
            const int b = static_cast<int>(t / in.rows), i = static_cast<int>(t % in.rows);
            for (int dy = 0; dy < in.kernel_rows; ++dy) {
                const int r = i + dy + in.row_shift;
                const long flat = static_cast<long>(b) * in.rows + r;
                if (r < 0 || r >= in.rows || (flat >= begin && flat < end)) continue;
                if (std::find(rows.begin(), rows.end(), flat) != rows.end()) continue;
                rows.push_back(flat);
                for (int c = 0; c < in.heads; ++c) {
                    const float* src = in.x + (static_cast<size_t>(b) * in.heads + c) * map + static_cast<size_t>(r) * in.cols;
                    data.insert(data.end(), src, src + in.cols);
                }
            }
        };
        for (long t = begin; t < std::min(end, begin + in.kernel_rows); ++t) visit(t);
        for (long t = std::max(begin, end - in.kernel_rows); t < end; ++t) visit(t);
    }
};

// The consecutive output rows [begin, end) of the calling thread of a parallel region, out of batch x rows.
// When the output replaces the input, `halo` holds the rows of neighbouring threads that these rows read,
// copied before any thread writes: every thread of the team must call this (it waits at a barrier).
struct ThreadRows {
    long begin, end;
    Halo halo;
};

// `work`: where given, the prefix sums of the rows' work (work[t] for rows [0, t), batch x rows + 1 entries), by which
// the rows are split instead of by count: rows whose masked tails are skipped differ in work (a causal map's last
// row has all its columns to compute, its first one vector), and an even split of a causal map's rows left one
// of two threads a quarter of the work.
inline ThreadRows thread_rows(const Input& in, bool in_place, const std::vector<long>* work = nullptr) {
    const long tasks = static_cast<long>(in.batch) * in.rows;
    const long count = omp_get_num_threads(), id = omp_get_thread_num();
    auto boundary = [&](long k) {
        if (!work) return tasks * k / count;
        const long target = (*work)[tasks] * k / count;  // the first row at or past the k-th share of the work
        return static_cast<long>(std::lower_bound(work->begin(), work->end(), target) - work->begin());
    };
    ThreadRows own{boundary(id), id + 1 == count ? tasks : boundary(id + 1), {}};
    if (in_place) {
        own.halo.capture(in, own.begin, own.end);
#pragma omp barrier
    }
    return own;
}

// Asks for the cache lines of `bytes` bytes from `p` ahead of their use.
inline void prefetch_line_by_line(const void* p, size_t bytes) {
    for (size_t offset = 0; offset < bytes; offset += 64) prefetch_line(static_cast<const char*>(p) + offset);
}

// Winograd's F(2, 3) along the columns (Lavin and Gray, 2016). A 3-tap correlation gives the outputs 2p and 2p + 1
// from the four inputs d0..d3 = a[2p - 1 .. 2p + 2] with four products instead of six:
//
//     t = (d0 - d2, d1 + d2, d2 - d1, d1 - d3)               (input transform)
//     u = (w0, (w0 + w1 + w2) / 2, (w0 - w1 + w2) / 2, w2)   (weight transform, once per call)
//     m = t * u;   y(2p) = m0 + m1 + m2,   y(2p + 1) = m1 - m2 - m3
//
// Output 2p reads only d0..d2 and output 2p + 1 only d1..d3, so padding, masks and causality hold as in the direct form
// (and a row's outputs do not depend on how many columns follow). Vectors hold 16 pairs (32 columns). Each prepared row
// is split once into its even and odd columns (E, O); a block forms t from them with two shifted loads, d0 = O[p - 1]
// and d3 = E[p + 1], and four adds (which do not compete with the multiply-adds for their ports), and interleaves its
// outputs once per vector. Storing the four transformed rows instead would make the ring twice as large: in backward
// the weight gradient, computed in the same pass, then loses to the cache what the input gradient gains
// (docs/performance.md, "Choices in the fused kernels"). The rounding differs from the direct form's by a few units in
// the last place.
#if defined(__AVX512F__)  // (16 lanes; the form runs only there, see winograd())
inline vfloat evens(vfloat a, vfloat b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
}

inline vfloat odds(vfloat a, vfloat b) {
    return __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Lanes [half * 8, half * 8 + 8) of `even` and `odd`, interleaved.
inline vfloat interleaved(vfloat even, vfloat odd, int half) {
    return half == 0 ? __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
                     : __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}
#else
inline vfloat evens(vfloat a, vfloat b) {
    vfloat r;
    for (int k = 0; k < kLanes / 2; ++k) r[k] = a[2 * k], r[kLanes / 2 + k] = b[2 * k];
    return r;
}

inline vfloat odds(vfloat a, vfloat b) {
    vfloat r;
    for (int k = 0; k < kLanes / 2; ++k) r[k] = a[2 * k + 1], r[kLanes / 2 + k] = b[2 * k + 1];
    return r;
}

inline vfloat interleaved(vfloat even, vfloat odd, int half) {
    vfloat r;
    for (int k = 0; k < kLanes / 2; ++k)
        r[2 * k] = even[half * kLanes / 2 + k], r[2 * k + 1] = odd[half * kLanes / 2 + k];
    return r;
}
#endif

inline int pair_vectors(int cols) { return (cols + 2 * kLanes - 1) / (2 * kLanes); }

// Floats per ring slot of split rows: a zero vector, the evens, a zero vector, the odds, a zero vector.
inline size_t split_floats(int stride) { return 2 * static_cast<size_t>(stride) + 3 * kLanes; }

// The prepared row `d` (zeros before column 0 and after the last) split into its even columns at `e` and its
// odd ones at e + stride + kLanes: the blocks form the transformed inputs from these with shifted loads.
inline void split_columns(const float* d, int cols, int stride, float* e) {
    float* o = e + stride + kLanes;
    for (int q = 0; q < pair_vectors(cols); ++q) {
        const vfloat low = load(d + 2 * kLanes * q), high = load(d + 2 * kLanes * q + kLanes);
        store(e + kLanes * q, evens(low, high));
        store(o + kLanes * q, odds(low, high));
    }
}

// Where the evens of ring slot `slot` of head c start (see RowRing::split).
inline float* split_slot(const RowRing& ring, int c, int slot, int kernel_rows) {
    return ring.split.data + (static_cast<size_t>(c) * kernel_rows + slot) * split_floats(ring.pair_stride) + kLanes;
}

// Fills the ring with the input rows of output row (b, i) (`keep_plain`: also as they were before the gate
// and the mask, see RowRing; `Split`: also split into even and odd columns for Winograd's form), requesting the
// cache lines of the next output row's as it goes, or with `defer_prefetch` listing them in ring.deferred for
// the caller to request (see PrefetchQueue).
template <bool Split = false>
void prepare_rows(const Input& in, int b, int i, RowRing& ring, const Halo* halo = nullptr, bool keep_plain = false,
                  bool defer_prefetch = false) {
    const int heads = in.heads, kr = in.kernel_rows;
    const int width = padded_width(in);
    const size_t map = static_cast<size_t>(in.rows) * in.cols;
    const bool separate_plain = keep_plain && (in.gate || in.in_keep);
    if (defer_prefetch) ring.deferred.restart();
    if (ring.width != width) {
        ring.width = width;
        ring.data.assign_zeros(static_cast<size_t>(heads) * kr * width);
        ring.tags.assign(kr, -1);
        if (separate_plain) ring.plain_data.assign_zeros(static_cast<size_t>(heads) * kr * width);
        if (Split) {
            ring.pair_stride = pair_vectors(in.cols) * kLanes;
            ring.split.assign_zeros(static_cast<size_t>(heads) * kr * split_floats(ring.pair_stride));
        }
    }
    for (int dy = 0; dy < kr; ++dy) {
        const int r = i + dy + in.row_shift;
        const int slot = ((r % kr) + kr) % kr;
        const bool inside = r >= 0 && r < in.rows;
        const long tag = inside ? static_cast<long>(b) * in.rows + r : -2;
        for (int c = 0; c < heads; ++c) {
            const size_t offset = (static_cast<size_t>(c) * kr + slot) * width + kLead;
            ring.lines[c * kr + dy] = ring.data.data + offset;
            ring.plain[c * kr + dy] = (separate_plain ? ring.plain_data.data : ring.data.data) + offset;
            if (Split) ring.evens_of[c * kr + dy] = split_slot(ring, c, slot, kr);
        }
        if (ring.tags[slot] == tag) continue;
        ring.tags[slot] = tag;
        const size_t row = static_cast<size_t>(r) * in.cols;
        const float* keep = in.in_keep && inside ? in.in_keep + b * map + row : nullptr;
        const long flat = static_cast<long>(b) * in.rows + r;
        // Past a masked tail's start the prepared row is zero (masked): only the columns before it are read.
        const int extent = inside && in.columns ? in.columns[flat] : in.cols;
        const int next_extent = in.columns && r + 1 < in.rows ? in.columns[flat + 1] : in.cols;
        for (int c = 0; c < heads; ++c) {
            float* dst = ring.data.data + (static_cast<size_t>(c) * kr + slot) * width + kLead;
            float* plain = separate_plain ? ring.plain_data.data + (dst - ring.data.data) : nullptr;
            float* split = Split ? split_slot(ring, c, slot, kr) : nullptr;
            if (!inside) {
                std::memset(dst, 0, sizeof(float) * in.cols);
                if (plain) std::memset(plain, 0, sizeof(float) * in.cols);
                if (split) std::memset(split, 0, sizeof(float) * (2 * ring.pair_stride + kLanes));
                continue;
            }
            const size_t start = (static_cast<size_t>(b) * heads + c) * map + row;
            const size_t gate_row = (static_cast<size_t>(b) * heads + c) * in.rows + r;
            if (r + 1 < in.rows) {
                // The next row of each head's maps, which the next output row prepares. The rows of all heads of S,
                // A_prev, the gradient and the gate are more streams at once than the hardware prefetchers follow:
                // requested here, backward takes less time with the maps out of cache (as in a training step;
                // docs/performance.md, "Choices in the fused kernels").
                const size_t bytes = sizeof(float) * next_extent;
                auto request = [&](const void* p, size_t count) {
                    if (defer_prefetch) ring.deferred.add(p, count);
                    else prefetch_line_by_line(p, count);
                };
                request(in.x + start + in.cols, bytes);
                if (in.lerp_end) request(in.lerp_end + start + in.cols, bytes);
                if (in.addend) request(in.addend + start + in.cols, bytes);
                if (in.gate) request(in.gate + gate_units(in.cols) * (gate_row + 1), gate_row_bytes(in.cols));
            }
            const float* copy = halo ? halo->find(static_cast<long>(b) * in.rows + r, c, in.cols, heads) : nullptr;
            const float* src = copy ? copy : in.x + start;
            if (in.lerp_end) {
                const float* end = in.lerp_end + start;
                for (int j = 0; j < extent; ++j) dst[j] = src[j] + in.lerp_weight * (end[j] - src[j]);
            } else if (in.addend) {
                const float* addend = in.addend + start;
                for (int j = 0; j < extent; ++j) dst[j] = src[j] + addend[j];
            } else {
                std::memcpy(dst, src, sizeof(float) * extent);
            }
            if (plain) std::memcpy(plain, dst, sizeof(float) * extent);
            if (in.gate) {  // (dst is zero past the last column, and so are the gate's bits there)
                const GateBits* gate = in.gate + gate_units(in.cols) * gate_row;
                for (int v = 0; v < (extent + kLanes - 1) / kLanes; ++v)
                    store(dst + v * kLanes, select_lanes(gate[v], load(dst + v * kLanes)));
            }
            if (keep)
                for (int j = 0; j < extent; ++j) dst[j] *= keep[j];
            if (extent < in.cols) {
                std::memset(dst + extent, 0, sizeof(float) * (in.cols - extent));
                if (plain) std::memset(plain + extent, 0, sizeof(float) * (in.cols - extent));
            }
            if (split) split_columns(dst, in.cols, ring.pair_stride, split);
        }
    }
}

struct Output {
    const float* w;  // [c][dy][dx][h] inside the kernel (ea_correlate takes [h][c][dy][dx] and reorders it)
    const float* bias;
    int relu;
    GateBits* saved;  // bit-packed (see the file comment)
    const float* out_keep;
    const float* blend;
    float blend_coef;
    float* out;
    float out_scale;
    float* out2;
    float out2_scale;
};

// The epilogue of one whole vector of outputs at flat offset `at` (see the file comment; `out_keep`: the mask
// at its columns).
inline void finish(const Input& in, const Output& o, vfloat y, size_t at, size_t gate_at, const float* out_keep,
                   const float* mixed_row = nullptr) {
    if (o.relu) y = y > 0.0f ? y : 0.0f;
    if (o.saved) o.saved[gate_at] = positive_lanes(y);
    if (out_keep) y *= load(out_keep);
    if (o.blend) {
        vfloat mixed;
        if (mixed_row) {
            mixed = load(mixed_row);  // the blend, already mixed, from the ring
        } else {
            mixed = load(o.blend + at);
            if (in.lerp_end) mixed += in.lerp_weight * (load(in.lerp_end + at) - mixed);
        }
        y += o.blend_coef * mixed;
    }
    if (o.out2) store(o.out2 + at, o.out2_scale * y);
    if (o.out_scale != 1.0f) y *= o.out_scale;
    store(o.out + at, y);
}

// A row's last, partial vector (`valid` < kLanes columns): finish's steps on zero-padded copies, of which the
// valid columns are written back. Out of line: it runs once per row and head, and inlined into the column loop
// it would slow the whole vectors' path.
__attribute__((noinline, cold)) void finish_partial(const Input& in, const Output& o, vfloat y, size_t at,
                                                    size_t gate_at, const float* out_keep, int valid,
                                                    const float* mixed_row) {
    float keep[kLanes] = {}, blend[kLanes] = {}, end[kLanes] = {}, out[kLanes], out2[kLanes];
    GateBits saved = 0;
    const size_t floats = sizeof(float) * valid;
    Input copies_in = in;  // what finish reads and writes, moved to the copies (at offset 0)
    Output copies = o;
    copies.out = out;
    copies.out2 = o.out2 ? out2 : nullptr;
    copies.saved = o.saved ? &saved : nullptr;
    if (out_keep) std::memcpy(keep, out_keep, floats);
    if (o.blend && !mixed_row) {  // (a ring row is zero beyond the last column: read as it is)
        std::memcpy(blend, o.blend + at, floats);
        copies.blend = blend;
        if (in.lerp_end) {
            std::memcpy(end, in.lerp_end + at, floats);
            copies_in.lerp_end = end;
        }
    }
    finish(copies_in, copies, y, 0, 0, out_keep ? keep : nullptr, mixed_row);
    std::memcpy(o.out + at, out, floats);
    if (o.out2) std::memcpy(o.out2 + at, out2, floats);
    if (o.saved) o.saved[gate_at] = static_cast<GateBits>(saved & ((1u << valid) - 1));  // none past the last column
}

// The epilogue of output head h's vector `y` at column j of output row (b, i) (`out_keep`: the mask's row; the blend
// read from the ring where `blend_in_ring`): finish, or finish_partial for a row's last, partial vector. Always inlined
// into the blocks' column loops: left to the compiler, the forward pass mostly takes longer (docs/performance.md,
// "Choices in the fused kernels").
__attribute__((always_inline)) inline void finish_vector(const Input& in, const Output& o, vfloat y, int b, int h,
                                                         int i, int j, const RowRing& ring, const float* out_keep,
                                                         bool blend_in_ring) {
    const size_t flat_row = (static_cast<size_t>(b) * in.heads + h) * in.rows + i;
    const size_t at = flat_row * in.cols + j;
    const float* mixed = blend_in_ring ? ring.plain[h * in.kernel_rows - in.row_shift] + j : nullptr;
    const float* keep = out_keep ? out_keep + j : nullptr;
    const int valid = std::min(kLanes, in.cols - j);
    if (valid == kLanes) finish(in, o, y, at, gate_unit(flat_row, in.cols, j), keep, mixed);
    else finish_partial(in, o, y, at, gate_unit(flat_row, in.cols, j), keep, valid, mixed);
}

// Vector registers of the target and how many of them one vfloat takes: the register blocking of output_row
// and of the weight gradient must fit, or the compiler spills accumulators to the stack inside the innermost loop.
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32, kRegistersPerVector = 1;
#elif defined(__AVX__)
constexpr int kVectorRegisters = 16, kRegistersPerVector = 1;
#else
constexpr int kVectorRegisters = 16, kRegistersPerVector = 2;
#endif

// Output heads computed together by output_row: 6 where the head count allows (else 4, else all). Fewer accumulators
// than 12 heads x 2 vectors leave the compiler registers for the loaded vectors and broadcasts (docs/performance.md,
// "Choices in the fused kernels").
template <int Heads>
constexpr int output_group() {
    if constexpr (Heads > 0 && Heads % 6 == 0) return 6;
    else if constexpr (Heads > 0 && Heads % 4 == 0) return 4;
    else return Heads;
}

// Column vectors per output head that output_row computes together: as many (up to 4) as keep the group's accumulators
// and the loaded input vectors in registers. Each loaded input vector then serves `group` heads and each broadcast
// weight V vectors: with one vector (7 loads, 6 of them broadcasts, per 6 multiply-adds) the loop waits on loads where
// a core has full-width 512-bit multiply-adds (docs/performance.md, "Choices in the fused kernels"). More vectors give
// the same bits (each output sums its taps in the same order). One vector on AVX2 targets, whose 16 registers hold 6
// accumulators of 2 halves each.
template <int Heads>
constexpr int output_vectors() {
    constexpr int group = output_group<Heads>();
    for (int vectors = 4; vectors >= 2; --vectors)
        if (group > 0 && (group * vectors + vectors) * kRegistersPerVector <= kVectorRegisters - 2) return vectors;
    return 1;
}

// Output heads [h0, h0 + group) x V vectors of columns from j0 of output row (b, i) whose input rows are in `ring`.
template <int Heads, int Cols, int V>
inline void output_block(const Input& in, const Output& o, int b, int i, int j0, int h0, const RowRing& ring,
                         const float* out_keep, bool blend_in_ring) {
    const int heads = Heads > 0 ? Heads : in.heads;
    constexpr int kGroup = output_group<Heads>();
    const int group = kGroup > 0 ? kGroup : heads;
    const int kernel_cols = Cols > 0 ? Cols : in.kernel_cols;
    const int pad = kernel_cols / 2, kr = in.kernel_rows;
    vfloat acc[kGroup > 0 ? kGroup : kMaxHeads][V];
    for (int g = 0; g < group; ++g)
        for (int u = 0; u < V; ++u) acc[g][u] = vfloat{} + (o.bias ? o.bias[h0 + g] : 0.0f);
    for (int c = 0; c < heads; ++c) {
        for (int dy = 0; dy < kr; ++dy) {
            const float* line = ring.lines[c * kr + dy] + j0 - pad;
#pragma GCC unroll 8
            for (int dx = 0; dx < kernel_cols; ++dx) {
                vfloat v[V];
#pragma GCC unroll 4
                for (int u = 0; u < V; ++u) v[u] = load(line + dx + u * kLanes);
                // The H weights of one tap are contiguous: broadcasts need no per-head offsets.
                const float* weight = o.w + ((static_cast<size_t>(c) * kr + dy) * kernel_cols + dx) * heads + h0;
#pragma GCC unroll 16
                for (int g = 0; g < group; ++g) {
                    const float w = weight[g];
#pragma GCC unroll 4
                    for (int u = 0; u < V; ++u) acc[g][u] += w * v[u];
                }
            }
        }
    }
    for (int u = 0; u < V; ++u)  // (only a block of one vector can reach past the last column)
        for (int g = 0; g < group; ++g)
            finish_vector(in, o, acc[g][u], b, h0 + g, i, j0 + u * kLanes, ring, out_keep, blend_in_ring);
}

// Whether the correlations take Winograd's form (see split_columns and output_row): 3-column kernels of
// a specialised head count, where a group's 4 x group accumulators and the 4 transformed input vectors fit in
// registers (AVX-512). Building with -DEA_HF_DIRECT_CONVOLUTION keeps the direct form everywhere (the tests
// compare the two).
template <int Heads, int Cols>
constexpr bool winograd() {
#if defined(EA_HF_DIRECT_CONVOLUTION)
    return false;
#else
    return Cols == 3 && Heads > 0 && (4 * output_group<Heads>() + 5) * kRegistersPerVector <= kVectorRegisters;
#endif
}

// Output heads [h0, h0 + group) x 32 columns from 32 q of output row (b, i) in Winograd's form, with the
// transformed weights o.w [c][dy][4][h] (see with_reordered_weights).
template <int Heads>
inline void winograd_block(const Input& in, const Output& o, int b, int i, int q, int h0, const RowRing& ring,
                           const float* out_keep, bool blend_in_ring) {
    constexpr int kGroup = output_group<Heads>();
    const int kr = in.kernel_rows, stride = ring.pair_stride;
    vfloat acc[kGroup][4] = {};
    for (int c = 0; c < Heads; ++c) {
        for (int dy = 0; dy < kr; ++dy) {
            const float* e = ring.evens_of[c * kr + dy] + q * kLanes;
            const float* odds_row = e + stride + kLanes;
            const vfloat even = load(e), odd = load(odds_row);
            const vfloat t0 = load(odds_row - 1) - odd, t1 = even + odd, t2 = odd - even, t3 = even - load(e + 1);
            const float* weight = o.w + (static_cast<size_t>(c) * kr + dy) * 4 * Heads + h0;
#pragma GCC unroll 16
            for (int g = 0; g < kGroup; ++g) {
                acc[g][0] += weight[g] * t0;
                acc[g][1] += weight[Heads + g] * t1;
                acc[g][2] += weight[2 * Heads + g] * t2;
                acc[g][3] += weight[3 * Heads + g] * t3;
            }
        }
    }
    for (int g = 0; g < kGroup; ++g) {
        const float bias = o.bias ? o.bias[h0 + g] : 0.0f;
        const vfloat even = acc[g][0] + acc[g][1] + acc[g][2] + bias;
        const vfloat odd = acc[g][1] - acc[g][2] - acc[g][3] + bias;
        const vfloat halves[2] = {interleaved(even, odd, 0), interleaved(even, odd, 1)};
        for (int u = 0; u < 2; ++u) {
            const int ju = 2 * kLanes * q + u * kLanes;
            if (ju >= in.cols) break;
            finish_vector(in, o, halves[u], b, h0 + g, i, ju, ring, out_keep, blend_in_ring);
        }
    }
}

// Masked tails are skipped a whole number of these columns at a time: 64 is a block of the direct form (4 vectors
// of 16 lanes) and two of Winograd's (32 columns), so that a row's correlated columns end where a block does.
constexpr int kTailColumns = 64;

// Columns [from, cols) of output row (b, i), a masked tail, for all heads: gate bits 0 (no gradient flows to the
// correlation there), the output 0 or, written in place, left as it is (the input: the caller's softmax masks
// these entries, and what is left there costs no pass over the map: a causal map's future is half of it).
inline void masked_tail(const Input& in, const Output& o, int b, int i, int from) {
    const size_t map = static_cast<size_t>(in.rows) * in.cols, row = static_cast<size_t>(i) * in.cols;
    const size_t floats = sizeof(float) * (in.cols - from);
    for (int h = 0; h < in.heads; ++h) {
        const size_t at = (static_cast<size_t>(b) * in.heads + h) * map + row + from;
        if (o.out != in.x) std::memset(o.out + at, 0, floats);
        if (o.out2) std::memset(o.out2 + at, 0, floats);
        if (o.saved) {
            const size_t first = gate_unit((static_cast<size_t>(b) * in.heads + h) * in.rows + i, in.cols, from);
            std::memset(o.saved + first, 0, sizeof(GateBits) * (gate_units(in.cols) - from / kLanes));
        }
    }
}

// Per flat row of a [B, 1, Q, K] mask, its last kept column (-1 where it has none: a padding query's row).
std::vector<int> last_kept_columns(const float* keep, long tasks, int cols, int threads) {
    std::vector<int> last(tasks);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tasks; ++t) {
        const float* mask = keep + t * static_cast<size_t>(cols);
        int j = cols - 1;
        while (j >= 0 && mask[j] == 0.0f) --j;
        last[t] = j;
    }
    return last;
}

// How one call computes each flat output row (b * rows + i), read from its masks by plan_rows.
struct RowPlan {
    // With `skip_masked_tails`, the columns to correlate: up to the row's last kept column, rounded up to
    // kTailColumns (at most `cols`); all columns in a row without a kept column (a padding query's, whose
    // probabilities are not masked). Where the caller masks, in every layer's softmax, the entries right of a
    // row's last kept column (a causal map's future, a batch's padded keys), these entries' outputs are never
    // read: a causal map's rows then cost as many columns as they have. Empty: every row whole.
    std::vector<int> columns;
    // 1 where the row's correlation is its bias alone, whatever the caller masks: every input row it reads is
    // masked whole (the rows of padding queries, and the zero rows outside the map), or its output row is
    // masked whole (where the call writes no gate). Such a row takes the epilogue alone (bias_row): each
    // product would add a zero (a finite weight times a masked zero) to the bias, so the outputs and gate bits
    // are the full correlation's. In a batch padded to N, these are the padding queries' rows beyond the
    // kernel's reach from the last real row: with masked tails skipped they were the larger part of the
    // correlation (N columns each, where a real row of a sequence of length L has L). Empty: none.
    std::vector<unsigned char> bias_only;

    // The row's work for thread_rows: the columns it correlates, plus a share for preparing its input rows and its
    // epilogue; a bias-only row's, a quarter of its columns. What such a row does is bound by memory, and a quarter
    // balances the threads of a padded batch best, better than a sixteenth (the share of a correlated row's
    // preparation) or a half (docs/performance.md, "Choices in the fused kernels").
    long work(long t, int cols) const {
        if (!bias_only.empty() && bias_only[t]) return cols / 4 + 1;
        return (columns.empty() ? cols : columns[t]) + cols / 16 + 1;
    }
    bool uniform() const { return columns.empty() && bias_only.empty(); }
};

// The plan of a call from the last kept columns (last_kept_columns) of the masks of its input rows (`last_in`,
// from in.in_keep) and of its output rows (`last_out`, only where no gate is written); either may be empty (no
// mask).
RowPlan plan_rows(const Input& in, const std::vector<int>& last_in, const std::vector<int>& last_out,
                  bool skip_masked_tails) {
    RowPlan plan;
    const long tasks = static_cast<long>(in.batch) * in.rows;
    if (skip_masked_tails && !last_in.empty()) {
        plan.columns.resize(tasks);
        for (long t = 0; t < tasks; ++t) {
            const int rounded = (last_in[t] + 1 + kTailColumns - 1) / kTailColumns * kTailColumns;
            plan.columns[t] = last_in[t] < 0 ? in.cols : std::min(in.cols, rounded);
        }
    }
#if !defined(EA_HF_CORRELATE_EVERY_ROW)  // (the tests' build to compare bias-only rows with their correlation)
    std::vector<unsigned char> bias_only(tasks, 0);
    bool any = false;
    for (long t = 0; t < tasks; ++t) {
        const int b = static_cast<int>(t / in.rows), i = static_cast<int>(t % in.rows);
        bool only_bias = !last_out.empty() && last_out[t] < 0;
        if (!only_bias && !last_in.empty()) {
            only_bias = true;
            for (int dy = 0; dy < in.kernel_rows && only_bias; ++dy) {
                const int r = i + dy + in.row_shift;
                only_bias = r < 0 || r >= in.rows || last_in[static_cast<long>(b) * in.rows + r] < 0;
            }
        }
        bias_only[t] = only_bias;
        any = any || only_bias;
    }
    if (any) plan.bias_only = std::move(bias_only);
#endif
    return plan;
}

// Prefix sums of the rows' work over one or more plans of the same rows (for thread_rows); empty where every
// row of every plan is uniform work.
std::vector<long> prefix_work(std::initializer_list<const RowPlan*> plans, long tasks, int cols) {
    std::vector<long> work;
    if (std::all_of(plans.begin(), plans.end(), [](const RowPlan* plan) { return plan->uniform(); })) return work;
    work.assign(tasks + 1, 0);
    for (long t = 0; t < tasks; ++t) {
        work[t + 1] = work[t];
        for (const RowPlan* plan : plans) work[t + 1] += plan->work(t, cols);
    }
    return work;
}

// Columns [0, columns) of output row (b, i), whose correlation is its bias alone (RowPlan::bias_only): finish's
// epilogue on the bias, as output_block and winograd_block give it when every product adds a zero.
inline void bias_row(const Input& in, const Output& o, int b, int i, int columns, const RowRing& ring,
                     const float* out_keep, bool blend_in_ring) {
    for (int h = 0; h < in.heads; ++h) {
        const vfloat bias = vfloat{} + (o.bias ? o.bias[h] : 0.0f);
        for (int j = 0; j < columns; j += kLanes) finish_vector(in, o, bias, b, h, i, j, ring, out_keep, blend_in_ring);
    }
}

// One output row (b, i) for all heads. `Heads` and `Cols` > 0 fix the head count and kernel width at compile
// time (accumulators in registers, taps unrolled); 0 reads them at run time (any size, slower).
// `spread_prefetch`: the next row's cache lines are requested a share before each block (see PrefetchQueue).
// Winograd's form (see split_columns) where winograd<Heads, Cols>() allows it, else the direct one.
//
// The correlations of ea_correlate and of backward's input gradient take Winograd's form where it applies; the weight
// gradient keeps the direct form, which is faster (docs/performance.md, "Choices in the fused kernels"). The weight
// gradient in Winograd's form is slower: its products are elementwise per transformed component, so each gradient
// vector serves one product instead of three and the pass waits on loads. As the transpose of forward's form (four sums
// a kernel row, transforms made once a row, 3 output heads x 2 input rows x 4 sums a block) it loses too: the
// transformed rows, twice as large, stream from L2.
template <int Heads, int Cols>
void output_row(const Input& in, const Output& o, int b, int i, RowRing& ring, const Halo* halo = nullptr,
                bool spread_prefetch = false) {
    const int heads = Heads > 0 ? Heads : in.heads;
    constexpr int kGroup = output_group<Heads>();
    const int group = kGroup > 0 ? kGroup : heads;
    const size_t map = static_cast<size_t>(in.rows) * in.cols, row = static_cast<size_t>(i) * in.cols;
    // The blend is this row of the input as prepared before the gate and the mask (A_in in forward, the incoming
    // gradient in backward): read from the ring rather than from the maps again. The maps' rows of different heads lie
    // 1 MiB apart at N = 512 (and S, A_prev and the output often at equal offsets modulo that), so they share cache
    // sets, and rows read one row earlier are mostly evicted again: read from the maps, the forward pass takes much
    // longer with the maps at such offsets (docs/performance.md, "Choices in the fused kernels").
    const int own = -in.row_shift, kr = in.kernel_rows;
    const bool blend_in_ring = o.blend == in.x && own >= 0 && own < kr;
    constexpr bool kWinograd = winograd<Heads, Cols>();
    prepare_rows<kWinograd>(in, b, i, ring, halo, blend_in_ring, spread_prefetch);
    const float* out_keep = o.out_keep ? o.out_keep + b * map + row : nullptr;
    // The columns to correlate: all, or up to the row's masked tail (a multiple of kTailColumns, see
    // RowPlan::columns); the rest of the row is its masked tail (see masked_tail).
    const int columns = in.columns ? in.columns[static_cast<size_t>(b) * in.rows + i] : in.cols;
    if (in.bias_only && in.bias_only[static_cast<size_t>(b) * in.rows + i]) {
        ring.deferred.issue(ring.deferred.pending);
        bias_row(in, o, b, i, columns, ring, out_keep, blend_in_ring);
    } else if constexpr (kWinograd) {
        const int vectors = pair_vectors(columns), groups = heads / group;
        const size_t share = spread_prefetch ? ring.deferred.pending / (std::max(vectors, 1) * groups) + 1 : 0;
        for (int q = 0; q < vectors; ++q)
            for (int h0 = 0; h0 < heads; h0 += group) {
                ring.deferred.issue(share);
                winograd_block<Heads>(in, o, b, i, q, h0, ring, out_keep, blend_in_ring);
            }
    } else {
        constexpr int kVectors = output_vectors<Heads>();
        const int whole = (columns / (kVectors * kLanes)) * kVectors * kLanes;
        const int blocks = std::max(1, (whole / (kVectors * kLanes) + (columns - whole + kLanes - 1) / kLanes) *
                                           ((heads + group - 1) / group));
        const size_t share = spread_prefetch ? ring.deferred.pending / blocks + 1 : 0;
        int j0 = 0;
        for (; j0 < whole; j0 += kVectors * kLanes)
            for (int h0 = 0; h0 < heads; h0 += group) {
                ring.deferred.issue(share);
                output_block<Heads, Cols, kVectors>(in, o, b, i, j0, h0, ring, out_keep, blend_in_ring);
            }
        for (; j0 < columns; j0 += kLanes)
            for (int h0 = 0; h0 < heads; h0 += group) {
                ring.deferred.issue(share);
                output_block<Heads, Cols, 1>(in, o, b, i, j0, h0, ring, out_keep, blend_in_ring);
            }
    }
    if (columns < in.cols) masked_tail(in, o, b, i, columns);
}

// `given` with its weights ([h][c][dy][dx]) copied into `reordered` as the kernel reads them, [c][dy][dx][h], or
// with `winograd` (3 columns) transformed, [c][dy][4][h] (see split_columns).
Output with_reordered_weights(const Output& given, int heads, int taps, std::vector<float>& reordered,
                              bool winograd = false) {
    Output o = given;
    if (winograd) {
        const int kernel_rows = taps / 3;
        reordered.resize(static_cast<size_t>(heads) * heads * kernel_rows * 4);
        for (int h = 0; h < heads; ++h)
            for (int c = 0; c < heads; ++c)
                for (int dy = 0; dy < kernel_rows; ++dy) {
                    const float* w = given.w + ((static_cast<size_t>(h) * heads + c) * kernel_rows + dy) * 3;
                    const float u[4] = {w[0], 0.5f * (w[0] + w[1] + w[2]), 0.5f * (w[0] - w[1] + w[2]), w[2]};
                    for (int k = 0; k < 4; ++k)
                        reordered[((static_cast<size_t>(c) * kernel_rows + dy) * 4 + k) * heads + h] = u[k];
                }
        o.w = reordered.data();
        return o;
    }
    reordered.resize(static_cast<size_t>(heads) * heads * taps);
    for (int h = 0; h < heads; ++h)
        for (int c = 0; c < heads; ++c)
            for (int t = 0; t < taps; ++t)
                reordered[(static_cast<size_t>(c) * taps + t) * heads + h] = given.w[(static_cast<size_t>(h) * heads + c) * taps + t];
    o.w = reordered.data();
    return o;
}

template <int Heads, int Cols>
void correlate(const Input& given_in, const Output& given, int threads, bool skip_masked_tails) {
    const int heads = given_in.heads, taps = given_in.kernel_rows * given_in.kernel_cols;
    std::vector<float> reordered;
    const Output o = with_reordered_weights(given, heads, taps, reordered, winograd<Heads, Cols>());
    Input in = given_in;
    const long tasks = static_cast<long>(in.batch) * in.rows;
    std::vector<int> last_in, last_out;
    if (in.in_keep) last_in = last_kept_columns(in.in_keep, tasks, in.cols, threads);
    // (An output row masked whole still writes its gate, taken before that mask, from the whole correlation.)
    if (o.out_keep && !o.saved) last_out = last_kept_columns(o.out_keep, tasks, in.cols, threads);
    const RowPlan plan = plan_rows(in, last_in, last_out, skip_masked_tails);
    in.columns = plan.columns.empty() ? nullptr : plan.columns.data();
    in.bias_only = plan.bias_only.empty() ? nullptr : plan.bias_only.data();
    const std::vector<long> work = prefix_work({&plan}, tasks, in.cols);
    // Each thread takes consecutive rows. Writing the output over the input is safe within a thread (an input
    // row is in the ring before its output row is written); the rows of neighbouring threads it reads are
    // copied before anyone writes.
    const bool in_place = o.out == in.x;
#pragma omp parallel num_threads(threads)
    {
        const ThreadRows own = thread_rows(in, in_place, work.empty() ? nullptr : &work);
        RowRing ring;
        for (long t = own.begin; t < own.end; ++t)
            output_row<Heads, Cols>(in, o, t / in.rows, t % in.rows, ring, in_place ? &own.halo : nullptr, true);
    }
}

// The most output heads whose Cols dot products (with the Cols shifted input vectors and one gradient vector)
// stay in registers, among the divisors of Heads up to 6; 0 when not even one fits.
template <int Heads, int Cols>
constexpr int weight_grad_group() {
    for (int group = 6; group >= 1; --group)
        if (Heads % group == 0 && (group * Cols + Cols + 1) * kRegistersPerVector <= kVectorRegisters - 2)
            return group;
    return 0;
}

// grad_w[g][dx] += sum over the columns of gy[g][j] * line[j + dx] for Group output heads: the Cols shifted
// input vectors are loaded once per column vector and serve all Group heads (Group x Cols accumulators in
// registers), so the loop is bound by multiply-adds rather than by loads. `grad_w` advances by `head_stride`
// per head and by one per tap.
template <int Group, int Cols>
inline void weight_grad_block(const float* line, const float* const* gy, int vectors, vfloat* grad_w,
                              size_t head_stride) {
    vfloat acc[Group][Cols] = {};
    const float* rows[Group];
    for (int g = 0; g < Group; ++g) rows[g] = gy[g];
    for (int v = 0; v < vectors; ++v) {
        vfloat x[Cols];
#pragma GCC unroll 8
        for (int dx = 0; dx < Cols; ++dx) {
            vfloat value = load(line + dx + v * kLanes);
            // Keep the loaded vectors in registers: folded into each multiply-add as memory operands, the
            // loads (the shifted ones mostly straddling cache lines) would be repeated for every product and
            // the loop would wait on loads.
            in_register(value);
            x[dx] = value;
        }
#pragma GCC unroll 8
        for (int g = 0; g < Group; ++g) {
            vfloat gradient = load(rows[g] + v * kLanes);
            in_register(gradient);
#pragma GCC unroll 8
            for (int dx = 0; dx < Cols; ++dx) acc[g][dx] += gradient * x[dx];
        }
    }
    for (int g = 0; g < Group; ++g)
        for (int dx = 0; dx < Cols; ++dx) grad_w[g * head_stride + dx] += acc[g][dx];
}

// Weight and bias gradient contributions of output row (b, i), added to per-thread vector accumulators
// grad_w[o][c][dy][dx] and grad_b[o].
// `gy[h]` is row i of the gated output gradient of head h, 64-byte aligned and zero beyond the last column
// up to whole vectors.
template <int Heads, int Cols>
void weight_grad_row(const Input& in, const float* const* gy, int b, int i, RowRing& ring,
                     std::vector<vfloat>& grad_w, std::vector<vfloat>& grad_b) {
    const int heads = Heads > 0 ? Heads : in.heads;
    const int kernel_cols = Cols > 0 ? Cols : in.kernel_cols;
    const int pad = kernel_cols / 2, kr = in.kernel_rows, taps = kr * kernel_cols;
    // (gy is zero past the row's masked tail, where there is one: its gate bits are)
    const int columns = in.columns ? in.columns[static_cast<size_t>(b) * in.rows + i] : in.cols;
    const int vectors = (columns + kLanes - 1) / kLanes;
    for (int h = 0; h < heads; ++h)
        for (int v = 0; v < vectors; ++v) grad_b[h] += load(gy[h] + v * kLanes);
    // A bias-only row's input rows are zero: its products would add zeros to the weight gradient.
    if (in.bias_only && in.bias_only[static_cast<size_t>(b) * in.rows + i]) return;
    prepare_rows(in, b, i, ring);
    constexpr int kGroup = Heads > 0 && Cols > 0 ? weight_grad_group<Heads, Cols>() : 0;
    if constexpr (kGroup > 0) {
        for (int c = 0; c < heads; ++c)
            for (int dy = 0; dy < kr; ++dy)
                for (int h0 = 0; h0 < heads; h0 += kGroup)
                    weight_grad_block<kGroup, Cols>(ring.lines[c * kr + dy] - pad, gy + h0, vectors,
                                                    grad_w.data() + (static_cast<size_t>(h0) * heads + c) * taps + dy * Cols,
                                                    static_cast<size_t>(heads) * taps);
        return;
    }
    // Any size: per (c, dy, dx) the H row dot products run over the columns with their accumulators in
    // registers.
    for (int c = 0; c < heads; ++c) {
        for (int dy = 0; dy < kr; ++dy) {
            const float* line = ring.lines[c * kr + dy] - pad;
            for (int dx = 0; dx < kernel_cols; ++dx) {
                vfloat acc[Heads > 0 ? Heads : kMaxHeads];
                for (int h = 0; h < heads; ++h) acc[h] = vfloat{};
                for (int v = 0; v < vectors; ++v) {
                    const vfloat x = load(line + dx + v * kLanes);
#pragma GCC unroll 16
                    for (int h = 0; h < heads; ++h) acc[h] += load(gy[h] + v * kLanes) * x;
                }
                for (int h = 0; h < heads; ++h) grad_w[(static_cast<size_t>(h) * heads + c) * taps + dy * kernel_cols + dx] += acc[h];
            }
        }
    }
}

// One thread's vector accumulators summed to floats: `sums` receives the weight gradient, then the bias's.
inline void lanes_sums(const std::vector<vfloat>& grad_w, const std::vector<vfloat>& grad_b,
                       std::vector<float>& sums) {
    sums.resize(grad_w.size() + grad_b.size());
    for (size_t k = 0; k < grad_w.size(); ++k) sums[k] = lanes_sum(grad_w[k]);
    for (size_t h = 0; h < grad_b.size(); ++h) sums[grad_w.size() + h] = lanes_sum(grad_b[h]);
}

// The whole backward of the evolution step in one pass over the rows: for row i, the input gradient (the
// transposed convolution of the gated gradient, as ea_correlate computes it) from a ring of gated gradient
// rows, then the weight and bias contributions of gradient row i, which that ring already holds gated. The
// input gradient may be written over the incoming gradient (out == grad), as ea_correlate writes over its input.
//
// With `skip_masked_tails` (and a mask), each row stops at its masked tail as ea_correlate's does: the gate bits
// are 0 there (forward wrote them so), and the caller's incoming gradient is 0 there (its softmax masks these
// entries, in every layer), so the gradients of the tail are 0 (written as 0, or left as they are in place) and
// the weight gradient has nothing to add from it.
template <int Heads, int Cols>
void backward(const Input& given_grad_in, const Output& grad_out, const Input& given_forward_in, float* grad_weight,
              float* grad_bias, int threads, bool skip_masked_tails) {
    const int heads = given_grad_in.heads, taps = given_grad_in.kernel_rows * given_grad_in.kernel_cols;
    const int kr = given_grad_in.kernel_rows, own_row = -given_grad_in.row_shift;
    const size_t weights = static_cast<size_t>(heads) * heads * taps;
    std::vector<float> reordered;
    const Output out = with_reordered_weights(grad_out, heads, taps, reordered, winograd<Heads, Cols>());
    Input grad_in = given_grad_in, forward_in = given_forward_in;
    // The input gradient's rows are bias-only (no bias: 0 before the blend) where the forward's keep masks them
    // whole; the weight gradient's rows have no products where the forward's were bias-only. (One mask, `keep`:
    // forward_in's in_keep and grad_out's out_keep.)
    const long tasks = static_cast<long>(grad_in.batch) * grad_in.rows;
    std::vector<int> last;
    if (forward_in.in_keep) last = last_kept_columns(forward_in.in_keep, tasks, forward_in.cols, threads);
    const RowPlan forward_plan = plan_rows(forward_in, last, {}, skip_masked_tails);
    const RowPlan grad_plan = plan_rows(grad_in, {}, last, false);
    grad_in.columns = forward_in.columns = forward_plan.columns.empty() ? nullptr : forward_plan.columns.data();
    grad_in.bias_only = grad_plan.bias_only.empty() ? nullptr : grad_plan.bias_only.data();
    forward_in.bias_only = forward_plan.bias_only.empty() ? nullptr : forward_plan.bias_only.data();
    const std::vector<long> work = prefix_work({&forward_plan, &grad_plan}, tasks, grad_in.cols);
    const bool in_place = out.out == grad_in.x;
    // Each thread's weight and bias gradients, added up in thread order afterwards: the same bits on every
    // run with the same thread count (an atomic or critical sum would depend on which thread finishes first).
    std::vector<std::vector<float>> partial(std::max(threads, 1));
    int team = 1;
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num();
#pragma omp single
        team = omp_get_num_threads();
        const ThreadRows own = thread_rows(grad_in, in_place, work.empty() ? nullptr : &work);
        RowRing gradient_ring, input_ring;
        std::vector<vfloat> grad_w(weights, vfloat{}), grad_b(heads, vfloat{});
        const float* rows[kMaxHeads];
        for (long t = own.begin; t < own.end; ++t) {
            const int b = static_cast<int>(t / grad_in.rows), i = static_cast<int>(t % grad_in.rows);
            output_row<Heads, Cols>(grad_in, out, b, i, gradient_ring, in_place ? &own.halo : nullptr);
            for (int h = 0; h < heads; ++h) rows[h] = gradient_ring.lines[h * kr + own_row];
            weight_grad_row<Heads, Cols>(forward_in, rows, b, i, input_ring, grad_w, grad_b);
        }
        lanes_sums(grad_w, grad_b, partial[id]);
    }
    std::fill(grad_weight, grad_weight + weights, 0.0f);
    std::fill(grad_bias, grad_bias + heads, 0.0f);
    for (int id = 0; id < team; ++id) {
        for (size_t k = 0; k < weights; ++k) grad_weight[k] += partial[id][k];
        for (int h = 0; h < heads; ++h) grad_bias[h] += partial[id][weights + h];
    }
}

// Specialised for the usual head counts with a 3-column kernel; anything else takes the generic version.
#define EA_DISPATCH(FUNCTION, HEADS, COLS, ...)                      \
    do {                                                             \
        if ((COLS) == 3) {                                           \
            switch (HEADS) {                                         \
                case 4: FUNCTION<4, 3>(__VA_ARGS__); return 0;       \
                case 8: FUNCTION<8, 3>(__VA_ARGS__); return 0;       \
                case 12: FUNCTION<12, 3>(__VA_ARGS__); return 0;     \
                case 16: FUNCTION<16, 3>(__VA_ARGS__); return 0;     \
                default: break;                                      \
            }                                                        \
        }                                                            \
        FUNCTION<0, 0>(__VA_ARGS__);                                 \
        return 0;                                                    \
    } while (0)

inline bool supported(int heads, int kernel_rows, int kernel_cols) {
    return heads >= 1 && heads <= kMaxHeads && kernel_rows >= 1 && kernel_rows <= kMaxKernelRows &&
           kernel_cols >= 1 && kernel_cols / 2 <= kLead;
}

}  // namespace

extern "C" {

// Both return 0 on success and 1 for sizes the kernels do not take (the caller checks them first).
// `skip_masked_tails` (with a mask): each row's correlation stops at its masked tail (after its last kept column,
// rounded up, see RowPlan::columns and masked_tail), for callers whose softmax masks those entries.
int ea_correlate(const float* x, const float* lerp_end, float lerp_weight, const void* gate, const float* in_keep,
                 const float* w, const float* bias, int batch, int heads, int rows, int cols, int kernel_rows,
                 int kernel_cols, int row_shift, int relu, void* saved, const float* out_keep, const float* blend,
                 float blend_coef, float* out, float out_scale, float* out2, float out2_scale, int threads,
                 int skip_masked_tails) {
    if (!supported(heads, kernel_rows, kernel_cols)) return 1;
    const Input in{x, lerp_end, lerp_weight, nullptr, static_cast<const GateBits*>(gate), in_keep, batch, heads,
                   rows, cols, kernel_rows, kernel_cols, row_shift};
    const Output o{w, bias, relu, static_cast<GateBits*>(saved), out_keep, blend, blend_coef, out, out_scale,
                   out2, out2_scale};
    EA_DISPATCH(correlate, heads, kernel_cols, in, o, threads, skip_masked_tails != 0);
}

// The evolution step's backward: gradients of S (out, times out_scale) and of A_prev (out2, times
// out2_scale) from the incoming gradient grad (+ grad_addend, where not NULL), the bit-packed ReLU gate and the
// flipped, transposed kernel w_t (rows read from i - row_shift_t on), and the weight and bias gradients of the
// beta-scaled kernel, whose input is S mixed with A_prev and masked, read from row i + row_shift on. `out` may
// be `grad` (written over it); neither output may be grad_addend. (The blend reads the incoming gradient from
// the ring, where the addend is already added: row_shift_t puts the output's own row in the ring.)
int ea_backward(const float* scores, const float* previous, float alpha, const float* keep, const float* grad,
                const float* grad_addend, const void* gate, const float* w_t, int batch, int heads, int rows, int cols,
                int kernel_rows, int kernel_cols, int row_shift, int row_shift_t, float blend_coef, float* out,
                float out_scale, float* out2, float out2_scale, float* grad_weight, float* grad_bias, int threads,
                int skip_masked_tails) {
    if (!supported(heads, kernel_rows, kernel_cols) || -row_shift_t < 0 || -row_shift_t >= kernel_rows) return 1;
    const Input grad_in{grad, nullptr, 0.0f, grad_addend, static_cast<const GateBits*>(gate), nullptr, batch, heads,
                        rows, cols, kernel_rows, kernel_cols, row_shift_t};
    const Output grad_out{w_t, nullptr, 0, nullptr, keep, grad, blend_coef, out, out_scale, out2, out2_scale};
    const Input forward_in{scores, previous, alpha, nullptr, nullptr, keep, batch, heads, rows, cols,
                           kernel_rows, kernel_cols, row_shift};
    EA_DISPATCH(backward, heads, kernel_cols, grad_in, grad_out, forward_in, grad_weight, grad_bias, threads,
                skip_masked_tails != 0);
}

// out[b, h, q, k] = keep[b, h, q, k] ? scale * x[b, h, q, k] : fill over float32 [B, H, Q, K] maps (`out` may be `x`):
// dropout's gradient and dropout(P) with dropout's bool mask (fill 0), a bool attention mask's zeros in a gradient
// (scale 1, fill 0) or its masked logits (scale 1, fill the float minimum). `keep` is bytes (torch.bool), contiguous
// along the keys, read with these element strides per batch, head and query (0 where it is broadcast). One pass, where
// torch's native_dropout_backward (grad * mask * scale) takes two, each with a map of its own, and torch's elementwise
// operators take a slow path for a bool operand (docs/performance.md, "Choices in the fused kernels").
int ea_select_kept(const float* x, const unsigned char* keep, long keep_batch, long keep_head, long keep_row,
                   float scale, float fill, float* out, int batch, int heads, int rows, int cols, int threads) {
    const long tasks = static_cast<long>(batch) * heads * rows;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tasks; ++t) {
        const long b = t / (static_cast<long>(heads) * rows), h = t / rows % heads, q = t % rows;
        const unsigned char* mask = keep + b * keep_batch + h * keep_head + q * keep_row;
        const float* in = x + t * static_cast<size_t>(cols);
        float* result = out + t * static_cast<size_t>(cols);
#pragma GCC ivdep
        for (int j = 0; j < cols; ++j) result[j] = mask[j] ? scale * in[j] : fill;
    }
    return 0;
}

int ea_kernel_version() { return 15; }
}
