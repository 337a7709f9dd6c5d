/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kernel_bench.cu — tallyd's CUDA kernels beside CUB and the memory ceilings, on one GPU, in one
 * run, on the same 1 GiB device-resident inputs.
 *
 * Ceilings: a device-to-device copy (cudaMemcpyAsync; bytes read + written) for filter and scan,
 * and a read-only pass (a kernel that reads every 16-byte vector once) for the histograms.
 * Every figure is bytes read + bytes written over the median of --reps timed runs (CUDA events
 * around each run, after warm-up runs), so a filter that keeps k % of 1 GiB counts
 * 1 GiB + k % of 1 GiB. Each tallyd operation is timed as the daemon issues it: the scratch
 * (re)initialisation kernel is inside the timed region. The filter inputs are uniform random
 * int32 in [0, 10^6) and the predicate is `lt t`, with t chosen for 0/5/50/95/100 % kept at
 * random positions; kept counts are checked against CUB's.
 *
 * A third ceiling, for the int64 scan: a widening copy (int32 in, int64 out, 12 bytes an element,
 * the scan's traffic without its arithmetic), because reads and writes in a 1:2 mix need not run
 * at the 1:1 copy's rate.
 *
 * The kernels run with the tuning row tallyd would select on this device (tk_cuda.h, "tuning";
 * its name is printed), or the row named by --tuning NAME. --sweep also times candidate rows (the
 * selected row with one field changed at a time: scan shapes and prefetch distances, colour
 * layouts and blocks per SM, histogram and minmax grids) on the same inputs, checking the
 * histograms' and minmax's results, so one device call measures every candidate; its lines
 * start with "sweep".
 *
 * Usage: kernel_bench [--reps N] [--label TEXT] [--tuning NAME] [--sweep] | --list-tunings.
 * Prints a table (op, GB/s, ratio to its ceiling, CUB's GB/s and ratio beside it) and exits
 * non-zero if a CUDA call or a count check fails.
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <cub/cub.cuh>
#include <cuda_runtime.h>

#include "bench_cuda.h"
#include "ceilings.h"
#include "tk_cuda.h"

#define TK(call)                                                                                   \
    do {                                                                                           \
        tally_status_t s_ = (call);                                                                \
        if (s_ != TALLY_OK) {                                                                      \
            fprintf(stderr, "%s:%d: %s: status %d (%s)\n", __FILE__, __LINE__, #call, (int)s_,     \
                    tk_cuda_error_string());                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static const size_t BYTES = (size_t)1 << 30;
static const size_t N32 = BYTES / 4;
static const int FILTER_RANGE = 1000000;
static int reps = 15;
static cudaStream_t stream;

static __host__ __device__ unsigned hash32(size_t i)
{
    unsigned long long x = i * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 29;
    return (unsigned)(x >> 32);
}

__global__ void gen_i32(int *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = (int)(hash32(i) % FILTER_RANGE);
}

/* kind 0: uniform bytes; 1: all equal (42); 2: narrow (8 values, 100..107). */
__global__ void gen_u8(unsigned *x, size_t words, int kind)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
         i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = hash32(i + 12345);
        x[i] = kind == 0 ? h : kind == 1 ? 0x2A2A2A2Au : 0x64646464u + (h & 0x07070707u);
    }
}

/* kind 0: uniform 12-bit values (a 12-bit sensor); 1: all equal (1234); 2: uniform 16-bit. */
__global__ void gen_u16(unsigned *x, size_t words, int kind)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
         i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = hash32(i + 777);
        x[i] = kind == 0 ? (h & 0x0fff0fffu) : kind == 1 ? 0x04d204d2u : h;
    }
}

/* The widening copy (the int64 scan's ceiling): int32 in, int64 out, each warp store covering
 * 512 contiguous bytes as the scan's do (lane pairs exchange halves with shuffles). */
__global__ void __launch_bounds__(256) widen(const int4 *in, longlong2 *out, size_t nv)
{
    const int lane = threadIdx.x & 31;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    /* Whole warps only: nv is a multiple of 32 here (1 GiB). */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += stride) {
        int4 x = __ldg(in + i);
        longlong2 *q = out + (i - lane) * 2;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int src = 16 * h + (lane >> 1);
            long long a0 = __shfl_sync(0xffffffffu, x.x, src),
                      a1 = __shfl_sync(0xffffffffu, x.y, src);
            long long a2 = __shfl_sync(0xffffffffu, x.z, src),
                      a3 = __shfl_sync(0xffffffffu, x.w, src);
            q[32 * h + lane] = (lane & 1) ? make_longlong2(a2, a3) : make_longlong2(a0, a1);
        }
    }
}

struct LessThan {
    int t;
    __host__ __device__ bool operator()(const int &x) const
    {
        return x < t;
    }
};

/* Median time in ms of `reps` runs of f on the stream, after 3 warm-up runs. */
static double time_ms(const std::function<void()> &f)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++)
        f();
    CK(cudaStreamSynchronize(stream));
    std::vector<float> t;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, stream));
        f();
        CK(cudaEventRecord(b, stream));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return t[t.size() / 2];
}

static double gbps(double bytes, double ms)
{
    return bytes / (ms * 1e-3) / 1e9;
}

struct Row {
    std::string op;
    double gb, ceiling;
    const char *ceiling_name;
    double cub;    /* 0 = none */
    double target; /* ratio to reach: 0.90 of ceiling, or (stable filter) CUB's figure */
};
static std::vector<Row> rows;

static void row(const std::string &op, double gb, double ceiling, const char *cname, double cub,
                double target)
{
    rows.push_back({op, gb, ceiling, cname, cub, target});
    printf("  %-34s %8.0f GB/s  %.3f x %s%s", op.c_str(), gb, gb / ceiling, cname,
           cub > 0 ? "" : "\n");
    if (cub > 0)
        printf("   (CUB %6.0f GB/s, %.3f)\n", cub, cub / ceiling);
    fflush(stdout);
}

/* The device buffers every measurement uses, and the ceilings measured first. */
struct Bench {
    int *d_i32;
    unsigned char *d_u8;
    void *d_out, *d_scratch, *d_cub;
    size_t cub_bytes;
    uint64_t *d_small; /* [0] kept, [1] carry, [2..] tk_hist_t (8 KiB with 4 channels) */
    int *d_cub_count;
    unsigned *d_sink;
    int sms;
    double copy, readc, widenc; /* GB/s */
};

static void bench_open(Bench &b)
{
    size_t scratch = tk_cuda_scratch_bytes_max(BYTES);
    CK(cudaMalloc(&b.d_i32, BYTES));
    CK(cudaMalloc(&b.d_u8, BYTES));
    CK(cudaMalloc(&b.d_out, 2 * BYTES));
    CK(cudaMalloc(&b.d_scratch, scratch ? scratch : 16));
    const size_t small_bytes = 16 + sizeof(tk_hist_t);
    CK(cudaMalloc(&b.d_small, small_bytes));
    CK(cudaMalloc(&b.d_cub_count, 16));
    CK(cudaMalloc(&b.d_sink, 16));
    CK(cudaMemset(b.d_small, 0, small_bytes));
    gen_i32<<<4096, 256, 0, stream>>>(b.d_i32, N32);
    CK(cudaGetLastError());

    /* CUB's temporary storage: the largest of the operations timed. */
    size_t t1 = 0, t2 = 0, t3 = 0, t4 = 0;
    CK(cub::DeviceSelect::If(nullptr, t1, b.d_i32, (int *)b.d_out, b.d_cub_count, (int)N32,
                             LessThan{0}, stream));
    CK(cub::DeviceScan::InclusiveSum(nullptr, t2, b.d_i32, (int *)b.d_out, (int)N32, stream));
    CK(cub::DeviceHistogram::HistogramEven(nullptr, t3, b.d_u8, (int *)b.d_out, 257, 0, 256,
                                           (int)BYTES, stream));
    CK(cub::DeviceHistogram::HistogramEven(nullptr, t4, b.d_i32, (int *)b.d_out, 257, 0,
                                           FILTER_RANGE, (int)N32, stream));
    b.cub_bytes = std::max(std::max(t1, t2), std::max(t3, t4));
    CK(cudaMalloc(&b.d_cub, b.cub_bytes));
}

static void bench_close(Bench &b)
{
    cudaFree(b.d_i32);
    cudaFree(b.d_u8);
    cudaFree(b.d_out);
    cudaFree(b.d_scratch);
    cudaFree(b.d_small);
    cudaFree(b.d_cub_count);
    cudaFree(b.d_sink);
    cudaFree(b.d_cub);
}

static void bench_ceilings(Bench &b)
{
    b.copy =
        gbps(2.0 * BYTES, time_ms([&] {
                 CK(cudaMemcpyAsync(b.d_out, b.d_i32, BYTES, cudaMemcpyDeviceToDevice, stream));
             }));
    b.readc = gbps(BYTES, time_ms([&] {
                       CK(bench_read_only_launch(b.d_i32, BYTES, b.d_sink, b.sms * 8, stream));
                   }));
    b.widenc = gbps(12.0 * N32, time_ms([&] {
                        widen<<<b.sms * 8, 256, 0, stream>>>((const int4 *)b.d_i32,
                                                             (longlong2 *)b.d_out, N32 / 4);
                    }));
    row("d2d copy (ceiling: filter, scan)", b.copy, b.copy, "copy", 0, 0);
    row("read-only (ceiling: hist, minmax)", b.readc, b.readc, "read", 0, 0);
    row("widen i32 -> i64 (ceiling: scan i64)", b.widenc, b.copy, "copy", 0, 0);
}

/* Filter, int32, lt t: unordered and stable, with CUB's stable DeviceSelect::If beside. False
 * when a kept count differs from CUB's. */
static bool bench_filter(Bench &b)
{
    const int pct[] = {0, 5, 50, 95, 100};
    for (int p : pct) {
        int t = (int)((long long)FILTER_RANGE * p / 100);
        tk_filter_spec_t s = {TALLY_PRED_LT, t, 0, 0};
        size_t tb = tk_cuda_filter_scratch_bytes(TALLY_DTYPE_I32, N32, 1);
        double cub_ms = time_ms([&] {
            CK(cub::DeviceSelect::If(b.d_cub, b.cub_bytes, b.d_i32, (int *)b.d_out, b.d_cub_count,
                                     (int)N32, LessThan{t}, stream));
        });
        int cub_kept = 0;
        CK(cudaMemcpy(&cub_kept, b.d_cub_count, 4, cudaMemcpyDeviceToHost));
        double bytes = (double)BYTES + 4.0 * cub_kept;
        double cub = gbps(bytes, cub_ms);
        for (int stable = 0; stable < 2; stable++) {
            s.stable = stable;
            double ms = time_ms([&] {
                TK(tk_cuda_filter(TALLY_DTYPE_I32, b.d_i32, N32, &s, b.d_out, &b.d_small[0],
                                  b.d_scratch, tb, stream));
            });
            uint64_t kept = 0;
            CK(cudaMemcpy(&kept, &b.d_small[0], 8, cudaMemcpyDeviceToHost));
            if (kept != (uint64_t)cub_kept) {
                fprintf(stderr, "filter %d%%: kept %llu, CUB %d\n", p, (unsigned long long)kept,
                        cub_kept);
                return false;
            }
            char name[64];
            snprintf(name, sizeof name, "filter %s i32, %3d%% kept",
                     stable ? "stable   " : "unordered", p);
            row(name, gbps(bytes, ms), b.copy, "copy", cub, stable ? cub / b.copy : 0.90);
        }
    }
    return true;
}

/* Scan int32 -> int64 and -> int32, inclusive, carry on the device. */
static void bench_scan(Bench &b)
{
    double cub = gbps(8.0 * N32, time_ms([&] {
                          CK(cub::DeviceScan::InclusiveSum(b.d_cub, b.cub_bytes, b.d_i32,
                                                           (int *)b.d_out, (int)N32, stream));
                      }));
    size_t sb = tk_cuda_scan_scratch_bytes(N32);
    int64_t *carry = (int64_t *)&b.d_small[1];
    double ms64 = time_ms([&] {
        TK(tk_cuda_scan(b.d_i32, N32, 0, 0, b.d_out, carry, carry, b.d_scratch, sb, stream));
    });
    double ms32 = time_ms([&] {
        TK(tk_cuda_scan(b.d_i32, N32, 0, 1, b.d_out, carry, carry, b.d_scratch, sb, stream));
    });
    row("scan i32 -> i64 (inclusive)", gbps(12.0 * N32, ms64), b.copy, "copy", cub, 0.90);
    row("scan i32 -> i64 (inclusive) vs widen", gbps(12.0 * N32, ms64), b.widenc, "widen", 0, 0.90);
    row("scan i32 -> i32 (inclusive)", gbps(8.0 * N32, ms32), b.copy, "copy", cub, 0.90);
}

static const char *const kinds[] = {"uniform", "all-equal", "narrow"};

/* Histograms: u8 on uniform, all-equal and narrow bytes; i32 over [0, 10^6). */
static void bench_hist(Bench &b)
{
    tk_hist_t *dh = (tk_hist_t *)&b.d_small[2];
    for (int k = 0; k < 3; k++) {
        gen_u8<<<4096, 256, 0, stream>>>((unsigned *)b.d_u8, BYTES / 4, k);
        CK(cudaGetLastError());
        double cub = gbps(BYTES, time_ms([&] {
                              CK(cub::DeviceHistogram::HistogramEven(b.d_cub, b.cub_bytes, b.d_u8,
                                                                     (int *)b.d_out, 257, 0, 256,
                                                                     (int)BYTES, stream));
                          }));
        double ms = time_ms([&] { TK(tk_cuda_hist_u8(b.d_u8, BYTES, dh, nullptr, 0, stream)); });
        row(std::string("hist u8 ") + kinds[k], gbps(BYTES, ms), b.readc, "read", cub, 0.90);
    }
    double cub = gbps(BYTES, time_ms([&] {
                          CK(cub::DeviceHistogram::HistogramEven(b.d_cub, b.cub_bytes, b.d_i32,
                                                                 (int *)b.d_out, 257, 0,
                                                                 FILTER_RANGE, (int)N32, stream));
                      }));
    double ms = time_ms(
        [&] { TK(tk_cuda_hist_i32(b.d_i32, N32, 0, FILTER_RANGE, dh, nullptr, 0, stream)); });
    row("hist i32 [0, 10^6) uniform", gbps(BYTES, ms), b.readc, "read", cub, 0.90);
}

/* Zeroes the device histogram dh before a checked run. The kernels run on `stream`, which does
 * not wait for the legacy default stream's cudaMemset/cudaMemcpy: synchronise on both sides. */
static void zero_hist(tk_hist_t *dh)
{
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemset(dh, 0, sizeof *dh));
    CK(cudaDeviceSynchronize());
}

/* After one run from zero: every channel counts every one of its n values (exits if not). */
static void check_channel_sums(const tk_hist_t *dh, size_t n, unsigned channels, bool ranged,
                               const char *what)
{
    static tk_hist_t h;
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(&h, dh, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned c = 0; c < channels; c++) {
        unsigned long long sum = ranged ? h.underflow + h.overflow : 0;
        for (int b = 0; b < 256; b++)
            sum += h.bins[c * 256 + b];
        if (sum != n) {
            fprintf(stderr, "%s: channel %u counts %llu of %zu\n", what, c, sum, n);
            exit(1);
        }
    }
}

/* Issue 12: uint16 (12-bit data over [0, 4096), all-equal, 16-bit over [0, 65536)), each
 * checked: every value counted. */
static void bench_hist_u16(Bench &b)
{
    tk_hist_t *dh = (tk_hist_t *)&b.d_small[2];
    const size_t n16 = BYTES / 2;
    struct {
        const char *name;
        int kind;
        int64_t hi;
    } u16s[] = {{"hist u16 [0, 4096) 12-bit uniform", 0, 4096},
                {"hist u16 [0, 4096) all-equal", 1, 4096},
                {"hist u16 [0, 65536) uniform", 2, 65536}};
    for (const auto &c : u16s) {
        gen_u16<<<4096, 256, 0, stream>>>((unsigned *)b.d_out, BYTES / 4, c.kind);
        CK(cudaGetLastError());
        const uint16_t *in = (const uint16_t *)b.d_out;
        zero_hist(dh);
        TK(tk_cuda_hist_u16(in, n16, 0, c.hi, dh, nullptr, 0, stream));
        check_channel_sums(dh, n16, 1, true, c.name);
        double ms =
            time_ms([&] { TK(tk_cuda_hist_u16(in, n16, 0, c.hi, dh, nullptr, 0, stream)); });
        row(c.name, gbps(BYTES, ms), b.readc, "read", 0, 0.90);
    }
}

/* Issue 12: colour (RGB, RGBA on uniform and all-equal bytes), each checked: every channel
 * counts every value. */
static void bench_hist_rgb(Bench &b)
{
    tk_hist_t *dh = (tk_hist_t *)&b.d_small[2];
    for (int k = 0; k < 2; k++) {
        gen_u8<<<4096, 256, 0, stream>>>((unsigned *)b.d_u8, BYTES / 4, k);
        CK(cudaGetLastError());
        for (unsigned channels = 3; channels <= 4; channels++) {
            size_t pixels = BYTES / channels;
            char name[96];
            snprintf(name, sizeof name, "hist %s %s", channels == 3 ? "rgb8" : "rgba8", kinds[k]);
            zero_hist(dh);
            TK(tk_cuda_hist_rgb(b.d_u8, pixels, channels, dh, nullptr, 0, stream));
            check_channel_sums(dh, pixels, channels, false, name);
            double ms = time_ms(
                [&] { TK(tk_cuda_hist_rgb(b.d_u8, pixels, channels, dh, nullptr, 0, stream)); });
            row(name, gbps((double)pixels * channels, ms), b.readc, "read", 0, 0.90);
        }
    }
}

/* minmax of int32, uint8 and uint16 (1 GiB, uniform), checked against the generator's range:
 * GB/s and the pair. */
static double minmax_once(Bench &b, uint8_t dtype, size_t n, int64_t *lo, int64_t *hi)
{
    int64_t *pair = (int64_t *)&b.d_small[0];
    double ms = time_ms([&] {
        TK(tk_cuda_minmax_reset(pair, stream));
        TK(tk_cuda_minmax(dtype, b.d_out, n, pair, stream));
    });
    int64_t h[2];
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(h, pair, sizeof h, cudaMemcpyDeviceToHost));
    *lo = h[0];
    *hi = h[1];
    return gbps(BYTES, ms);
}

static const struct {
    const char *name;
    uint8_t dtype;
    size_t esize;
} minmax_types[] = {{"minmax i32 uniform", TALLY_DTYPE_I32, 4},
                    {"minmax u8 uniform", TALLY_DTYPE_U8, 1},
                    {"minmax u16 uniform", TALLY_DTYPE_U16, 2}};

/* Fills d_out with uniform 32-bit words whose extremes are known: every byte value, every
 * 16-bit value and INT32_MIN / INT32_MAX appear. */
static void minmax_input(Bench &b)
{
    gen_u8<<<4096, 256, 0, stream>>>((unsigned *)b.d_out, BYTES / 4, 0);
    CK(cudaGetLastError());
    const unsigned ends[] = {0x80000000u, 0x7fffffffu, 0x0000ffffu, 0xff000000u};
    CK(cudaMemcpyAsync((char *)b.d_out + BYTES / 2, ends, sizeof ends, cudaMemcpyHostToDevice,
                       stream));
    CK(cudaStreamSynchronize(stream));
}

static bool minmax_ok(uint8_t dtype, int64_t lo, int64_t hi)
{
    return dtype == TALLY_DTYPE_I32 ? lo == INT32_MIN && hi == INT32_MAX
                                    : lo == 0 && hi == (dtype == TALLY_DTYPE_U8 ? 255 : 65535);
}

static void bench_minmax(Bench &b)
{
    minmax_input(b);
    for (const auto &m : minmax_types) {
        int64_t lo, hi;
        double g = minmax_once(b, m.dtype, BYTES / m.esize, &lo, &hi);
        if (!minmax_ok(m.dtype, lo, hi)) {
            fprintf(stderr, "%s: %lld..%lld\n", m.name, (long long)lo, (long long)hi);
            exit(1);
        }
        row(m.name, g, b.readc, "read", 0, 0.90);
    }
}

/* ---- --sweep: candidate tuning rows -------------------------------------------------------- */

/* One sweep line: what, the candidate, GB/s and the ratio to the ceiling. */
static void sweep_line(const char *what, const char *cand, double gb, double ceiling,
                       const char *cname)
{
    printf("sweep | %-34s | %-26s | %6.0f GB/s | %.3f x %s\n", what, cand, gb, gb / ceiling, cname);
    fflush(stdout);
}

static const char *const shape_names[TK_SCAN_SHAPES] = {"V8",       "V8 lean",     "V12 lean",
                                                        "V16 lean", "V12 lean x4", "V16 lean x3"};

static void sweep_scan(Bench &b, const tk_cuda_tuning_t &base)
{
    size_t sb = tk_cuda_scan_scratch_bytes(N32);
    int64_t *carry = (int64_t *)&b.d_small[1];
    const unsigned prefetch[] = {0, 132, 264, 528, 1056};
    for (unsigned shape = TK_SCAN_V8; shape < TK_SCAN_SHAPES; shape++) {
        for (unsigned p : prefetch) {
            if (shape == TK_SCAN_V8 && p) /* the legacy shape does not prefetch */
                continue;
            if (shape >= TK_SCAN_V12_LEAN_B4 && p > 132) /* far prefetches lost everywhere */
                continue;
            tk_cuda_tuning_t t = base;
            t.scan_shape = t.scan_shape_i32 = shape;
            t.scan_prefetch_tiles = p;
            TK(tk_cuda_tuning_use(&t));
            char cand[64];
            snprintf(cand, sizeof cand, "%s, prefetch %u", shape_names[shape], p);
            for (int out32 = 0; out32 < 2; out32++) {
                double ms = time_ms([&] {
                    TK(tk_cuda_scan(b.d_i32, N32, 0, out32, b.d_out, carry, carry, b.d_scratch, sb,
                                    stream));
                });
                sweep_line(out32 ? "scan i32 -> i32" : "scan i32 -> i64", cand,
                           gbps((out32 ? 8.0 : 12.0) * N32, ms), b.copy, "copy");
            }
        }
    }
}

static void sweep_hist(Bench &b, const tk_cuda_tuning_t &base)
{
    tk_hist_t *dh = (tk_hist_t *)&b.d_small[2];
    const size_t n16 = BYTES / 2;
    const int64_t his[] = {4096, 4096, 65536};
    for (int kind = 0; kind < 3; kind++) {
        gen_u16<<<4096, 256, 0, stream>>>((unsigned *)b.d_out, BYTES / 4, kind);
        CK(cudaGetLastError());
        for (unsigned per_sm = 2; per_sm <= 4; per_sm++) {
            tk_cuda_tuning_t t = base;
            t.hist_blocks_per_sm = per_sm;
            TK(tk_cuda_tuning_use(&t));
            const uint16_t *in = (const uint16_t *)b.d_out;
            zero_hist(dh);
            TK(tk_cuda_hist_u16(in, n16, 0, his[kind], dh, nullptr, 0, stream));
            check_channel_sums(dh, n16, 1, true, "sweep u16");
            double ms = time_ms(
                [&] { TK(tk_cuda_hist_u16(in, n16, 0, his[kind], dh, nullptr, 0, stream)); });
            char what[64], cand[64];
            snprintf(what, sizeof what, "hist u16 [0, %lld) %s", (long long)his[kind],
                     kind == 1 ? "all-equal" : "uniform");
            snprintf(cand, sizeof cand, "%u blocks/SM", per_sm);
            sweep_line(what, cand, gbps(BYTES, ms), b.readc, "read");
        }
    }
    for (int k = 0; k < 3; k++) {
        gen_u8<<<4096, 256, 0, stream>>>((unsigned *)b.d_u8, BYTES / 4, k);
        CK(cudaGetLastError());
        for (unsigned per_sm = 2; per_sm <= 4; per_sm++) {
            tk_cuda_tuning_t t = base;
            t.hist_blocks_per_sm = per_sm;
            TK(tk_cuda_tuning_use(&t));
            double ms =
                time_ms([&] { TK(tk_cuda_hist_u8(b.d_u8, BYTES, dh, nullptr, 0, stream)); });
            char what[64], cand[64];
            snprintf(what, sizeof what, "hist u8 %s", kinds[k]);
            snprintf(cand, sizeof cand, "%u blocks/SM", per_sm);
            sweep_line(what, cand, gbps(BYTES, ms), b.readc, "read");
        }
    }
}

static void sweep_rgb(Bench &b, const tk_cuda_tuning_t &base)
{
    tk_hist_t *dh = (tk_hist_t *)&b.d_small[2];
    const struct {
        unsigned layout, per_sm;
        const char *name;
    } cands[] = {{TK_RGB_PACKED, 3, "packed, 3 blocks/SM"},
                 {TK_RGB_PACKED, 2, "packed, 2 blocks/SM"},
                 {TK_RGB_COPIES16, 4, "16 copies"},
                 {TK_RGB_COPIES32, 4, "32 copies"}};
    for (int k = 0; k < 2; k++) {
        gen_u8<<<4096, 256, 0, stream>>>((unsigned *)b.d_u8, BYTES / 4, k);
        CK(cudaGetLastError());
        for (unsigned channels = 3; channels <= 4; channels++) {
            for (const auto &c : cands) {
                tk_cuda_tuning_t t = base;
                t.rgb_layout = c.layout;
                t.rgb_blocks_per_sm = c.per_sm;
                TK(tk_cuda_tuning_use(&t));
                size_t pixels = BYTES / channels;
                char what[64];
                snprintf(what, sizeof what, "hist %s %s", channels == 3 ? "rgb8" : "rgba8",
                         kinds[k]);
                zero_hist(dh);
                TK(tk_cuda_hist_rgb(b.d_u8, pixels, channels, dh, nullptr, 0, stream));
                check_channel_sums(dh, pixels, channels, false, what);
                double ms = time_ms([&] {
                    TK(tk_cuda_hist_rgb(b.d_u8, pixels, channels, dh, nullptr, 0, stream));
                });
                sweep_line(what, c.name, gbps((double)pixels * channels, ms), b.readc, "read");
            }
        }
    }
}

static void sweep_minmax(Bench &b, const tk_cuda_tuning_t &base)
{
    minmax_input(b);
    const unsigned blocks[] = {2, 4, 8};
    for (const auto &m : minmax_types) {
        for (unsigned unroll = 1; unroll <= 4; unroll += 3) {
            for (unsigned per_sm : blocks) {
                tk_cuda_tuning_t t = base;
                t.minmax_blocks_per_sm = per_sm;
                t.minmax_unroll = unroll;
                TK(tk_cuda_tuning_use(&t));
                int64_t lo, hi;
                double g = minmax_once(b, m.dtype, BYTES / m.esize, &lo, &hi);
                if (!minmax_ok(m.dtype, lo, hi)) {
                    fprintf(stderr, "sweep %s: %lld..%lld\n", m.name, (long long)lo, (long long)hi);
                    exit(1);
                }
                char cand[64];
                snprintf(cand, sizeof cand, "%u blocks/SM, %u loads", per_sm, unroll);
                sweep_line(m.name, cand, g, b.readc, "read");
            }
        }
    }
}

/* The table for RESULTS.md. */
static void print_table(void)
{
    printf("\n| op | GB/s | ratio to ceiling | CUB GB/s | CUB ratio | target | met |\n");
    printf("|---|---:|---:|---:|---:|---|---|\n");
    for (const Row &r : rows) {
        char cub[32] = "", cubr[32] = "", tgt[48] = "", met[8] = "";
        if (r.cub > 0) {
            snprintf(cub, sizeof cub, "%.0f", r.cub);
            snprintf(cubr, sizeof cubr, "%.3f", r.cub / r.ceiling);
        }
        if (r.target > 0) {
            bool vs_cub = r.op.find("stable") != std::string::npos;
            snprintf(tgt, sizeof tgt, vs_cub ? ">= CUB" : ">= 0.90 x %s", r.ceiling_name);
            snprintf(met, sizeof met, "%s", r.gb / r.ceiling >= r.target ? "yes" : "no");
        }
        printf("| %s | %.0f | %.3f x %s | %s | %s | %s | %s |\n", r.op.c_str(), r.gb,
               r.gb / r.ceiling, r.ceiling_name, cub, cubr, tgt, met);
    }
}

int main(int argc, char **argv)
{
    std::string label = "";
    const char *tuning = nullptr;
    bool sweep = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = std::max(10, atoi(argv[++i]));
        else if (!strcmp(argv[i], "--label") && i + 1 < argc)
            label = argv[++i];
        else if (!strcmp(argv[i], "--tuning") && i + 1 < argc)
            tuning = argv[++i];
        else if (!strcmp(argv[i], "--sweep"))
            sweep = true;
        else if (!strcmp(argv[i], "--list-tunings")) {
            for (unsigned r = 0; r < tk_cuda_tuning_rows(); r++)
                printf("%s\n", tk_cuda_tuning_row(r)->name);
            return 0;
        } else {
            fprintf(stderr, "usage: kernel_bench [--reps N] [--label TEXT] [--tuning NAME] "
                            "[--sweep] | --list-tunings\n");
            return 2;
        }
    }
    int dev = 0;
    cudaDeviceProp prop;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    const tk_cuda_tuning_t *row = nullptr;
    if (tuning && !(row = tk_cuda_tuning_find(tuning))) {
        fprintf(stderr, "kernel_bench: no tuning row %s\n", tuning);
        return 2;
    }
    if (!row)
        TK(tk_cuda_tuning_select(dev, &row));
    TK(tk_cuda_tuning_use(row));
    printf("kernel_bench %s: %s, %d SMs, 1 GiB inputs, median of %d runs, tuning row %s%s\n",
           label.c_str(), prop.name, prop.multiProcessorCount, reps, row->name,
           tuning ? " (--tuning)" : " (selected)");
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Bench b = {};
    b.sms = prop.multiProcessorCount;
    bench_open(b);
    bench_ceilings(b);
    if (sweep) {
        sweep_scan(b, *row);
        sweep_hist(b, *row);
        sweep_rgb(b, *row);
        sweep_minmax(b, *row);
        TK(tk_cuda_tuning_use(row));
    }
    if (!bench_filter(b))
        return 1;
    bench_scan(b);
    bench_hist(b);
    bench_hist_u16(b);
    bench_hist_rgb(b);
    bench_minmax(b);
    print_table();
    bench_close(b);
    cudaStreamDestroy(stream);
    return 0;
}
