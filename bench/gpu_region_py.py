# SPDX-License-Identifier: Apache-2.0
"""Device regions from Python (issue 23, PROTOCOL.md §10 "Device memory"): the GB/s that
`client.hist(r)` reaches on a GpuRegion read in place by tallyd's GPU, the figure the CuPy example
of docs/c-and-python.md quotes. Run by scripts/gpu-check.sh STEPS=gpu-region-py against a tallyd
on the GPU (--backend cuda); on the dev box it runs against simulated GPUs (TALLY_TEST_SIM_GPU=1,
a tallyd with --test-sim-gpus) only to check that it works, its figures meaningless.

For each size (64 and 256 MiB): the region filled (through CuPy when it is installed, in place
through cupy.asarray(r); else copied in with r.copy_from), one hist checked against NumPy on the
same bytes, then THREADS threads each with its own client and region (a region answers only
the client that registered it) calling hist(r) back to back for SECONDS: THREADS requests in
flight, as the C benchmark's 8 (libtally releases the GIL in its calls). Prints one line per
size: "gpu-region-py: hist u8 SIZE MiB, T in flight: G GB/s (N requests)", and what filled the
regions. With PyTorch: torch.as_tensor(r, device="cuda") filled in place, and a hist of it.

usage: python3 gpu_region_py.py ENDPOINT [THREADS] [SECONDS]
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, List

import numpy as np

import tally

MIB = 1 << 20


def fill(r: tally.GpuRegion, seed: int) -> np.ndarray:
    """Fills r with random bytes on the GPU (CuPy) or through the host; returns a host copy."""
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        data = np.random.default_rng(seed).integers(0, 256, r.nbytes, dtype=np.uint8)
        r.copy_from(data)
        return data
    a = cupy.asarray(r)  # a view of the region: no copy
    a[:] = cupy.random.default_rng(seed).integers(0, 256, r.nbytes, dtype=cupy.uint8)
    cupy.cuda.get_current_stream().synchronize()  # the data is there before the request
    return r.to_host()


def filler() -> str:
    try:
        import cupy  # type: ignore[import-not-found]  # noqa: F401
        return "CuPy (cupy.asarray(r), in place)"
    except ImportError:
        return "r.copy_from (CuPy not installed)"


def rate(endpoint: str, size: int, threads: int, seconds: float) -> None:
    clients: List[tally.Client] = [tally.Client(endpoint, 30000) for _ in range(threads)]
    regions = [c.gpu_region(size) for c in clients]
    try:
        for i, r in enumerate(regions):
            host = fill(r, i)
            if i == 0:  # the answer is the histogram of those bytes
                np.testing.assert_array_equal(clients[0].hist(r), np.bincount(host, minlength=256))
        counts = [0] * threads
        stop = time.monotonic() + seconds

        def worker(k: int) -> None:
            while time.monotonic() < stop:
                clients[k].hist(regions[k])
                counts[k] += 1

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        t0 = time.monotonic()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        elapsed = time.monotonic() - t0
        total = sum(counts)
        print(f"gpu-region-py: hist u8 {size // MIB} MiB, {threads} in flight: "
              f"{total * size / elapsed / 1e9:.0f} GB/s ({total} requests)", flush=True)
    finally:
        for r in regions:
            r.close()
        for c in clients:
            c.close()


def torch_check(endpoint: str) -> None:
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        print("gpu-region-py: PyTorch not installed: torch.as_tensor not checked")
        return
    with tally.Client(endpoint, 30000) as c, c.gpu_region(MIB, "i32") as r:
        t: Any = torch.as_tensor(r, device="cuda")  # a view of the region
        t.copy_(torch.arange(MIB // 4, dtype=torch.int32, device="cuda") % 200 - 100)
        torch.cuda.synchronize()
        got = c.hist(r, range=(-100, 100))
        # PROTOCOL.md's bin of x in [lo, hi): (x - lo) * 256 // (hi - lo); 200 values over 256
        # bins leave some bins empty, so the whole histogram is compared
        vals = np.arange(MIB // 4, dtype=np.int64) % 200 - 100
        want = np.bincount((vals + 100) * 256 // 200, minlength=256)
        ok = bool(np.array_equal(np.asarray(got[:256]), want))
        print(f"gpu-region-py: torch.as_tensor(r, device='cuda') filled in place: hist "
              f"{'right' if ok else 'WRONG'}")


def main() -> int:
    endpoint = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    print(f"gpu-region-py: regions filled by {filler()}")
    for size in (64 * MIB, 256 * MIB):
        rate(endpoint, size, threads, seconds)
    torch_check(endpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
