/* SPDX-License-Identifier: Apache-2.0 */
/*
 * lane_bench.cu — the GPU alone under tallyd's launch sequences (issue 34): what the device-region
 * rows of test_gpu_region could reach if tallyd's host side cost nothing. R requests, round robin
 * over S CUDA streams (tallyd's lanes), all enqueued at once, each one the sequence a lane
 * enqueues for it (td_gpu_cuda.c), on one device buffer as the bench rows use one region:
 *   hist          memset of the histogram, the kernel, a copy of it to pinned memory, an event
 *   filter, scan  the kernel(s), a copy of the 8-byte count or carry to pinned memory, an event
 * Prints GB/s (input bytes; filter and scan also bytes read + written) against the read and copy
 * ceilings of the same run, and the host's microseconds a request to enqueue the sequence. (A
 * histogram that finished itself in one launch was measured with it and left out: bench/NOTES.md,
 * "Fewer driver calls a histogram".)
 *
 *   lane_bench [--explore] [TOTAL_GIB (default 16)]
 */
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_cuda.h"
#include "ceilings.h"
#include "tk_cuda.h"

#define MAX_STREAMS 8

namespace {

enum variant { HIST_TODAY, READ_ONLY, FILTER, SCAN };
const char *const names[] = {"hist (memset, kernel, copy, event)", "read-only pass",
                             "filter (kernel, copy, event)", "scan (kernels, copy, event)"};

struct lanes {
    cudaStream_t s[MAX_STREAMS];
    cudaEvent_t ev[MAX_STREAMS];
    tk_hist_t *d_hist[MAX_STREAMS]; /* today's: zeroed by the memset */
    uint64_t *d_small[MAX_STREAMS];
    void *d_out[MAX_STREAMS];
    void *d_scratch[MAX_STREAMS];
    size_t scratch_bytes;
    unsigned *d_sink;
    tk_hist_t *h_hist; /* pinned, one per stream */
    uint64_t *h_small; /* pinned, one per stream */
};

double now_s()
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

void open_lanes(lanes &L, size_t out_bytes, size_t n_i32)
{
    L.scratch_bytes = std::max(tk_cuda_scan_scratch_bytes(n_i32),
                               tk_cuda_filter_scratch_bytes(TALLY_DTYPE_I32, n_i32, 0));
    for (int k = 0; k < MAX_STREAMS; k++) {
        CK(cudaStreamCreateWithFlags(&L.s[k], cudaStreamNonBlocking));
        CK(cudaEventCreateWithFlags(&L.ev[k], cudaEventDisableTiming));
        CK(cudaMalloc(&L.d_hist[k], sizeof(tk_hist_t)));
        CK(cudaMalloc(&L.d_small[k], 64));
        CK(cudaMemset(L.d_small[k], 0, 64));
        CK(cudaMalloc(&L.d_out[k], out_bytes));
        CK(cudaMalloc(&L.d_scratch[k], L.scratch_bytes ? L.scratch_bytes : 16));
    }
    CK(cudaMalloc(&L.d_sink, 64));
    CK(cudaMallocHost(&L.h_hist, MAX_STREAMS * sizeof(tk_hist_t)));
    CK(cudaMallocHost(&L.h_small, MAX_STREAMS * sizeof(uint64_t)));
}

void check(tally_status_t st)
{
    if (st != TALLY_OK) {
        fprintf(stderr, "lane_bench: a kernel call failed: %s\n", tk_cuda_error_string());
        exit(1);
    }
}

/* Enqueues request i's sequence on stream k. */
void enqueue(lanes &L, variant v, int k, const void *d_in, size_t bytes)
{
    cudaStream_t s = L.s[k];
    static const tk_filter_spec_t spec = {TALLY_PRED_GT, 0, 0, 0};
    switch (v) {
    case HIST_TODAY:
        CK(cudaMemsetAsync(L.d_hist[k], 0, sizeof(tk_hist_t), s));
        check(tk_cuda_hist(TALLY_DTYPE_U8, d_in, bytes, 0, 0, L.d_hist[k], NULL, 0, s));
        CK(cudaMemcpyAsync(&L.h_hist[k], L.d_hist[k], sizeof(tk_hist_t), cudaMemcpyDeviceToHost,
                           s));
        CK(cudaEventRecord(L.ev[k], s));
        break;
    case READ_ONLY: {
        int sms = 0;
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        CK(bench_read_only_launch(d_in, bytes, L.d_sink, sms * 8, s));
        break;
    }
    case FILTER:
        check(tk_cuda_filter(TALLY_DTYPE_I32, d_in, bytes / 4, &spec, L.d_out[k], L.d_small[k],
                             L.d_scratch[k], L.scratch_bytes, s));
        CK(cudaMemcpyAsync(&L.h_small[k], L.d_small[k], 8, cudaMemcpyDeviceToHost, s));
        CK(cudaEventRecord(L.ev[k], s));
        break;
    case SCAN: {
        int64_t *carry = (int64_t *)L.d_small[k];
        check(tk_cuda_scan((const int32_t *)d_in, bytes / 4, 0, 0, L.d_out[k], carry, carry, L.d_scratch[k],
                           L.scratch_bytes, s));
        CK(cudaMemcpyAsync(&L.h_small[k], carry, 8, cudaMemcpyDeviceToHost, s));
        CK(cudaEventRecord(L.ev[k], s));
        break;
    }
    }
}

/* GB/s of input over `reqs` requests on `streams` streams, the median of 3 runs after one
 * untimed; *enqueue_us: the host's time a request to enqueue them. */
double run(lanes &L, variant v, int streams, const void *d_in, size_t bytes, int reqs,
           double *enqueue_us)
{
    double rates[3], enq[3];
    for (int rep = -1; rep < 3; rep++) {
        CK(cudaDeviceSynchronize());
        double t0 = now_s();
        for (int i = 0; i < reqs; i++)
            enqueue(L, v, i % streams, d_in, bytes);
        double t1 = now_s();
        CK(cudaDeviceSynchronize());
        double t2 = now_s();
        if (rep >= 0) {
            rates[rep] = (double)bytes * reqs / (t2 - t0) / 1e9;
            enq[rep] = (t1 - t0) / reqs * 1e6;
        }
    }
    std::sort(rates, rates + 3);
    std::sort(enq, enq + 3);
    *enqueue_us = enq[1];
    return rates[1];
}

/* --explore: where the histogram's time goes, GPU alone: its rate on one stream by
 * size (the fixed cost a kernel), by resident blocks per SM (the tuning row's
 * hist_blocks_per_sm) at 1, 2 and 4 streams, on random and all-equal bytes (the bench rows'
 * regions hold all-equal bytes), and on one buffer against 8 buffers in turn (requests that
 * read the same bytes at once share L2: the bench rows read one region). */
void explore(lanes &L, double read, double total_gib)
{
    const size_t most = 256ull << 20;
    void *bufs[8];
    for (auto &b : bufs) {
        CK(cudaMalloc(&b, most));
        CK(cudaMemset(b, 3, most));
    }
    const tk_cuda_tuning_t *row = NULL;
    if (tk_cuda_tuning_select(0, &row) != TALLY_OK || !row)
        exit(1);
    tk_cuda_tuning_t t = *row;
    auto rate = [&](size_t bytes, int streams, int rotate) {
        int reqs = (int)(total_gib * (1ull << 30) / bytes);
        double best[3];
        for (int rep = -1; rep < 3; rep++) {
            CK(cudaDeviceSynchronize());
            double t0 = now_s();
            for (int i = 0; i < reqs; i++)
                enqueue(L, HIST_TODAY, i % streams, bufs[i % rotate], bytes);
            CK(cudaDeviceSynchronize());
            if (rep >= 0)
                best[rep] = (double)bytes * reqs / (now_s() - t0) / 1e9;
        }
        std::sort(best, best + 3);
        return best[1];
    };
    for (size_t mib : {16, 32, 64, 128, 256}) {
        double g = rate(mib << 20, 1, 8);
        printf("lane_bench: explore, size, 1 stream, 8 buffers, all-equal: %3zu MiB %5.0f GB/s "
               "%.3f x read, %.1f us a kernel, %.1f us over the read ceiling\n",
               mib, g, g / read, (double)(mib << 20) / g / 1e3,
               (double)(mib << 20) / g / 1e3 - (double)(mib << 20) / read / 1e3);
    }
    for (unsigned b = 1; b <= 4; b++) {
        t.hist_blocks_per_sm = b;
        if (tk_cuda_tuning_use(&t) != TALLY_OK)
            continue;
        for (int streams : {1, 2, 4})
            printf("lane_bench: explore, blocks/SM %u, 64 MiB, %d streams: one buffer %.3f, 8 "
                   "buffers %.3f x read; 256 MiB: one %.3f, 8 %.3f\n",
                   b, streams, rate(64ull << 20, streams, 1) / read,
                   rate(64ull << 20, streams, 8) / read, rate(256ull << 20, streams, 1) / read,
                   rate(256ull << 20, streams, 8) / read);
    }
    (void)tk_cuda_tuning_use(NULL);
    for (auto &b : bufs)
        CK(cudaFree(b));
}

} // namespace

int main(int argc, char **argv)
{
    bool exploring = argc > 1 && strcmp(argv[1], "--explore") == 0;
    if (exploring) {
        argc--;
        argv++;
    }
    double total_gib = argc > 1 ? atof(argv[1]) : 16;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    double read = bench_read_ceiling(1ull << 30, 15), copy = bench_copy_ceiling(1ull << 30, 15);
    printf("lane_bench: %s, ceilings read %.0f GB/s, d2d copy %.0f GB/s (read + written)\n",
           prop.name, read, copy);
    if (exploring) {
        lanes L;
        open_lanes(L, 64, 16);
        explore(L, read, total_gib);
        return 0;
    }
    const size_t big = 256ull << 20;
    std::vector<uint8_t> host(big);
    uint64_t x = 88172645463325252ull;
    for (auto &b : host) { /* xorshift: every byte value, positive and negative int32s */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b = (uint8_t)(x >> 32);
    }
    void *d_in = NULL;
    CK(cudaMalloc(&d_in, big));
    CK(cudaMemcpy(d_in, host.data(), big, cudaMemcpyHostToDevice));
    lanes L;
    open_lanes(L, (32ull << 20) * 2, (32ull << 20) / 4);
    struct row {
        variant v;
        size_t bytes;
    } rows[] = {{READ_ONLY, 64ull << 20}, {HIST_TODAY, 64ull << 20}, {HIST_TODAY, 256ull << 20},
                {FILTER, 32ull << 20},
                {SCAN, 32ull << 20}};
    const int stream_counts[] = {1, 4, 8};
    for (const row &r : rows) {
        int reqs = (int)(total_gib * (1ull << 30) / r.bytes);
        for (int streams : stream_counts) {
            double enq, gbps = run(L, r.v, streams, d_in, r.bytes, reqs, &enq);
            /* bytes read + written an input byte: the filter writes what it kept (the count
             * copied back to pinned memory), the int64 scan twice its input */
            double moved = r.v == FILTER  ? 1 + (double)L.h_small[0] * 4 / (double)r.bytes
                           : r.v == SCAN ? 3
                                         : 1;
            double ceiling = r.v == FILTER || r.v == SCAN ? copy : read;
            printf("lane_bench: %-42s %3zu MiB, %d streams: %6.0f GB/s in, %.3f x %s; enqueue "
                   "%.1f us a request\n",
                   names[r.v], r.bytes >> 20, streams, gbps, gbps * moved / ceiling,
                   moved > 1 ? "copy" : "read", enq);
        }
    }
    return 0;
}
