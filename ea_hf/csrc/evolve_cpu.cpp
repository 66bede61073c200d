// Fused CPU kernels of Evolving Attention's convolution step (ea_hf/kernels.py compiles and loads them).
//
// Maps are float32, contiguous [B, H, Q, K]; masks are [B, 1, Q, K] (shared by the heads); outside the map
// the convolution reads zeros. The input a map's rows are read from is
//
//     a = x + lerp_weight * (lerp_end - x)     (lerp_end != NULL; else a = x)
//     a = a * gate                             (gate != NULL: the 0/1 ReLU gate of backward, one byte each)
//     a = a * in_keep                          (in_keep != NULL)
//
// ea_correlate computes, per batch b, output head o, row i and column j,
//
//     v = bias[o] + sum_{c, dy, dx} w[o, c, dy, dx] * a[b, c, i + dy + row_shift, j + dx - kc / 2]
//     v = max(v, 0)                            (relu)
//     saved[b, o, i, j] = v > 0                (saved != NULL: the ReLU gate for backward, one byte each)
//     v = v * out_keep[b, ., i, j]             (out_keep != NULL)
//     v = v + blend_coef * blend'[b, o, i, j]  (blend != NULL, mixed with lerp_end like x)
//     out[b, o, i, j] = out_scale * v;  out2[b, o, i, j] = out2_scale * v  (out2 != NULL)
//
// which is the forward step (ReLU, blend with A_in) and, with the kernel flipped and transposed and the ReLU
// gate, the input gradient (mask, blend with the incoming gradient, split between S and A_prev by the residual
// weights: out and out2). ea_weight_grad computes the weight and
// bias gradients, sum over b, i, j of gy[b, o, i, j] * a[b, c, i + dy + row_shift, j + dx - kc / 2] with
// gy = grad * gate. Neither materialises the gated gradient or the masked input.
//
// No torch headers: a plain shared library called through ctypes, which compiles in about a second. Threads
// come from OpenMP, the runtime torch itself uses.

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;  // one 512-bit vector of floats (the compiler splits it where vectors are narrower)
constexpr int kBlocks = 2;  // vectors of columns per step: 2 x H accumulators stay in registers for H <= 12
constexpr int kMaxHeads = 64;
constexpr int kMaxKernelRows = 8;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat load(const float* p) {
    vfloat v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline float lanes_sum(vfloat v) {
    float values[kLanes], total = 0.0f;
    store(values, v);
    for (int k = 0; k < kLanes; ++k) total += values[k];
    return total;
}

struct Input {  // where rows of `a` come from
    const float* x;
    const float* lerp_end;
    float lerp_weight;
    const unsigned char* gate;
    const float* in_keep;
    int batch, heads, rows, cols, kernel_rows, kernel_cols, row_shift;
};

// The input rows that output rows read, prepared (mixed, gated, masked) with zero borders so that every
// vector load is in bounds: a ring of `kernel_rows` slots per head. Consecutive output rows share all but one
// input row, so each input row is prepared once per thread.
struct RowRing {
    std::vector<float> data;
    std::vector<long> tags;  // which (batch, row) each slot holds; -1 empty, -2 the zero row outside the map
    int width = 0;
    const float* lines[kMaxHeads * kMaxKernelRows];  // [c][dy] -> first column of that row (after the border)
};

inline int padded_width(const Input& in) {
    const int step = kLanes * kBlocks;
    return ((in.cols + step - 1) / step) * step + 2 * (in.kernel_cols / 2) + step;
}

void prepare_rows(const Input& in, int b, int i, RowRing& ring) {
    const int heads = in.heads, kr = in.kernel_rows, pad = in.kernel_cols / 2;
    const int width = padded_width(in);
    const size_t map = static_cast<size_t>(in.rows) * in.cols;
    if (ring.width != width) {
        ring.width = width;
        ring.data.assign(static_cast<size_t>(heads) * kr * width, 0.0f);
        ring.tags.assign(kr, -1);
    }
    for (int dy = 0; dy < kr; ++dy) {
        const int r = i + dy + in.row_shift;
        const int slot = ((r % kr) + kr) % kr;
        const bool inside = r >= 0 && r < in.rows;
        const long tag = inside ? static_cast<long>(b) * in.rows + r : -2;
        for (int c = 0; c < heads; ++c)
            ring.lines[c * kr + dy] = ring.data.data() + (static_cast<size_t>(c) * kr + slot) * width + pad;
        if (ring.tags[slot] == tag) continue;
        ring.tags[slot] = tag;
        const size_t row = static_cast<size_t>(r) * in.cols;
        const float* keep = in.in_keep && inside ? in.in_keep + b * map + row : nullptr;
        for (int c = 0; c < heads; ++c) {
            float* dst = ring.data.data() + (static_cast<size_t>(c) * kr + slot) * width + pad;
            if (!inside) {
                std::memset(dst, 0, sizeof(float) * in.cols);
                continue;
            }
            const size_t start = (static_cast<size_t>(b) * heads + c) * map + row;
            const float* src = in.x + start;
            if (in.lerp_end) {
                const float* end = in.lerp_end + start;
                for (int j = 0; j < in.cols; ++j) dst[j] = src[j] + in.lerp_weight * (end[j] - src[j]);
            } else {
                std::memcpy(dst, src, sizeof(float) * in.cols);
            }
            if (in.gate) {
                const unsigned char* gate = in.gate + start;
                for (int j = 0; j < in.cols; ++j) dst[j] = gate[j] ? dst[j] : 0.0f;
            }
            if (keep)
                for (int j = 0; j < in.cols; ++j) dst[j] *= keep[j];
        }
    }
}

struct Output {
    const float* w;
    const float* bias;
    int relu;
    unsigned char* saved;
    const float* out_keep;
    const float* blend;
    float blend_coef;
    float* out;
    float out_scale;
    float* out2;
    float out2_scale;
};

// One output row (b, i) for all heads. `Heads` and `Cols` > 0 fix the head count and kernel width at compile
// time (accumulators in registers, taps unrolled); 0 reads them at run time (any size, slower).
template <int Heads, int Cols>
void output_row(const Input& in, const Output& o, int b, int i, RowRing& ring) {
    const int heads = Heads > 0 ? Heads : in.heads;
    const int kernel_cols = Cols > 0 ? Cols : in.kernel_cols;
    const int pad = kernel_cols / 2, kr = in.kernel_rows, taps = kr * kernel_cols;
    const int step = kLanes * kBlocks;
    const size_t map = static_cast<size_t>(in.rows) * in.cols, row = static_cast<size_t>(i) * in.cols;
    prepare_rows(in, b, i, ring);
    const float* out_keep = o.out_keep ? o.out_keep + b * map + row : nullptr;
    for (int j0 = 0; j0 < in.cols; j0 += step) {
        vfloat acc[Heads > 0 ? Heads : kMaxHeads][kBlocks];
        for (int h = 0; h < heads; ++h)
            for (int k = 0; k < kBlocks; ++k) acc[h][k] = vfloat{} + o.bias[h];
        for (int c = 0; c < heads; ++c) {
            for (int dy = 0; dy < kr; ++dy) {
                const float* line = ring.lines[c * kr + dy] + j0 - pad;
#pragma GCC unroll 8
                for (int dx = 0; dx < kernel_cols; ++dx) {
                    vfloat v[kBlocks];
                    for (int k = 0; k < kBlocks; ++k) v[k] = load(line + dx + k * kLanes);
                    const float* weight = o.w + static_cast<size_t>(c) * taps + dy * kernel_cols + dx;
#pragma GCC unroll 16
                    for (int h = 0; h < heads; ++h) {
                        const float w = weight[static_cast<size_t>(h) * heads * taps];
                        for (int k = 0; k < kBlocks; ++k) acc[h][k] += w * v[k];
                    }
                }
            }
        }
        const int valid = std::min(step, in.cols - j0);
        for (int h = 0; h < heads; ++h) {
            const size_t at = (static_cast<size_t>(b) * heads + h) * map + row + j0;
            float values[kLanes * kBlocks];
            for (int k = 0; k < kBlocks; ++k) {
                vfloat y = acc[h][k];
                if (o.relu) y = y > 0.0f ? y : 0.0f;
                store(values + k * kLanes, y);
            }
            if (o.saved)
                for (int j = 0; j < valid; ++j) o.saved[at + j] = values[j] > 0.0f;
            if (out_keep)
                for (int j = 0; j < valid; ++j) values[j] *= out_keep[j0 + j];
            if (o.blend && in.lerp_end) {
                for (int j = 0; j < valid; ++j) {
                    const float mixed = o.blend[at + j] + in.lerp_weight * (in.lerp_end[at + j] - o.blend[at + j]);
                    values[j] += o.blend_coef * mixed;
                }
            } else if (o.blend) {
                for (int j = 0; j < valid; ++j) values[j] += o.blend_coef * o.blend[at + j];
            }
            if (o.out2)
                for (int j = 0; j < valid; ++j) o.out2[at + j] = o.out2_scale * values[j];
            if (o.out_scale != 1.0f)
                for (int j = 0; j < valid; ++j) values[j] *= o.out_scale;
            std::memcpy(o.out + at, values, sizeof(float) * valid);
        }
    }
}

template <int Heads, int Cols>
void correlate(const Input& in, const Output& o, int threads) {
    const int tasks = in.batch * in.rows;
#pragma omp parallel num_threads(threads)
    {
        RowRing ring;  // per thread; a static schedule hands each thread consecutive rows
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; ++t) output_row<Heads, Cols>(in, o, t / in.rows, t % in.rows, ring);
    }
}

// Weight and bias gradient contributions of output row (b, i), added to per-thread vector accumulators
// grad_w[o][c][dy][dx] and grad_b[o]. Per (c, dy, dx) the H row dot products run over the columns with
// their accumulators in registers.
template <int Heads, int Cols>
void weight_grad_row(const Input& in, const float* grad, const unsigned char* gate, int b, int i, RowRing& ring,
                     std::vector<float>& gated, std::vector<vfloat>& grad_w, std::vector<vfloat>& grad_b) {
    const int heads = Heads > 0 ? Heads : in.heads;
    const int kernel_cols = Cols > 0 ? Cols : in.kernel_cols;
    const int pad = kernel_cols / 2, kr = in.kernel_rows, taps = kr * kernel_cols;
    const int vectors = (in.cols + kLanes - 1) / kLanes, stride = vectors * kLanes;
    const size_t map = static_cast<size_t>(in.rows) * in.cols, row = static_cast<size_t>(i) * in.cols;
    prepare_rows(in, b, i, ring);
    // gy for this row, all heads, zero-padded to whole vectors.
    gated.assign(static_cast<size_t>(heads) * stride, 0.0f);
    for (int h = 0; h < heads; ++h) {
        const size_t at = (static_cast<size_t>(b) * heads + h) * map + row;
        float* dst = gated.data() + static_cast<size_t>(h) * stride;
        for (int j = 0; j < in.cols; ++j) dst[j] = gate[at + j] ? grad[at + j] : 0.0f;
        for (int v = 0; v < vectors; ++v) grad_b[h] += load(dst + v * kLanes);
    }
    for (int c = 0; c < heads; ++c) {
        for (int dy = 0; dy < kr; ++dy) {
            const float* line = ring.lines[c * kr + dy] - pad;
            for (int dx = 0; dx < kernel_cols; ++dx) {
                vfloat acc[Heads > 0 ? Heads : kMaxHeads];
                for (int h = 0; h < heads; ++h) acc[h] = vfloat{};
                for (int v = 0; v < vectors; ++v) {
                    const vfloat x = load(line + dx + v * kLanes);
#pragma GCC unroll 16
                    for (int h = 0; h < heads; ++h) acc[h] += load(gated.data() + static_cast<size_t>(h) * stride + v * kLanes) * x;
                }
                for (int h = 0; h < heads; ++h) grad_w[(static_cast<size_t>(h) * heads + c) * taps + dy * kernel_cols + dx] += acc[h];
            }
        }
    }
}

template <int Heads, int Cols>
void weight_grad(const Input& in, const float* grad, const unsigned char* gate, float* grad_weight, float* grad_bias,
                 int threads) {
    const int heads = in.heads, taps = in.kernel_rows * in.kernel_cols, tasks = in.batch * in.rows;
    const size_t weights = static_cast<size_t>(heads) * heads * taps;
    std::fill(grad_weight, grad_weight + weights, 0.0f);
    std::fill(grad_bias, grad_bias + heads, 0.0f);
#pragma omp parallel num_threads(threads)
    {
        RowRing ring;
        std::vector<float> gated;
        std::vector<vfloat> grad_w(weights, vfloat{}), grad_b(heads, vfloat{});
#pragma omp for schedule(static) nowait
        for (int t = 0; t < tasks; ++t)
            weight_grad_row<Heads, Cols>(in, grad, gate, t / in.rows, t % in.rows, ring, gated, grad_w, grad_b);
#pragma omp critical
        {
            for (size_t k = 0; k < weights; ++k) grad_weight[k] += lanes_sum(grad_w[k]);
            for (int h = 0; h < heads; ++h) grad_bias[h] += lanes_sum(grad_b[h]);
        }
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

inline bool supported(int heads, int kernel_rows) {
    return heads >= 1 && heads <= kMaxHeads && kernel_rows >= 1 && kernel_rows <= kMaxKernelRows;
}

}  // namespace

extern "C" {

// Both return 0 on success and 1 for sizes the kernels do not take (the caller checks them first).
int ea_correlate(const float* x, const float* lerp_end, float lerp_weight, const unsigned char* gate, const float* in_keep,
                 const float* w, const float* bias, int batch, int heads, int rows, int cols, int kernel_rows,
                 int kernel_cols, int row_shift, int relu, unsigned char* saved, const float* out_keep, const float* blend,
                 float blend_coef, float* out, float out_scale, float* out2, float out2_scale, int threads) {
    if (!supported(heads, kernel_rows)) return 1;
    const Input in{x, lerp_end, lerp_weight, gate, in_keep, batch, heads, rows, cols, kernel_rows, kernel_cols,
                   row_shift};
    const Output o{w, bias, relu, saved, out_keep, blend, blend_coef, out, out_scale, out2, out2_scale};
    EA_DISPATCH(correlate, heads, kernel_cols, in, o, threads);
}

int ea_weight_grad(const float* x, const float* lerp_end, float lerp_weight, const float* in_keep, const float* grad, const unsigned char* gate, int batch,
                   int heads, int rows, int cols, int kernel_rows, int kernel_cols, int row_shift,
                   float* grad_weight, float* grad_bias, int threads) {
    if (!supported(heads, kernel_rows)) return 1;
    const Input in{x, lerp_end, lerp_weight, nullptr, in_keep, batch, heads, rows, cols, kernel_rows, kernel_cols,
                   row_shift};
    EA_DISPATCH(weight_grad, heads, kernel_cols, in, grad, gate, grad_weight, grad_bias, threads);
}

int ea_kernel_version() { return 4; }
}
