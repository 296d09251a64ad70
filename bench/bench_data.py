"""Data loading never stalls a step: `TokenFileDataset.batch` and `SampleOrder.microbatch_ids` per
micro-batch, next to the forward + backward of one micro-batch of a small GPT on the CPU, in one run.

Run: .venv/bin/python bench/bench_data.py [--quick]

A tokens file of random uint16 ids (100M tokens, 200 MB; `--quick`: 20M) is written to a temporary
directory and read as the runtime reads it: seq_len 1024, micro-batches of 8 samples whose ids come from
`SampleOrder` (global batch 512, so 64 micro-batches per step). The file's pages are first dropped from the
page cache (fsync, then posix_fadvise DONTNEED; mincore shows how much stayed resident); it is opened and
given the start-up vocabulary check (`check_vocab`: about 1M tokens in 64 chunks spread over the file) as
`open_dataset` does, then a first pass reads cold: every sample is a page fault served by the disk. Then
the whole file is read once and a second, longer pass reads warm. The step is one micro-batch's forward +
backward (loss included) through a GPT of 4 layers (embedding, two blocks of hidden 128 and 4 heads, head to
an 8,192-token vocabulary) on one thread, median of a few runs. GPT-2's 50,304-token head would make that
step about 7x longer (~25 s on the shared machine): the smaller step keeps the run short and only makes the
ratio harder to meet. `SampleOrder.microbatch_ids` is timed on its own, over a run that crosses an epoch
boundary, for a data set of 100k samples and one of 2^40 (the largest the spec accepts): each position's id
is computed (`EpochShuffle`), so neither an epoch's start nor the data set's size costs more. Beside it, in
the same run, the order it replaced: a `torch.randperm` of every id drawn at each epoch's start, for 10M
samples (its time and its tensor's bytes).

The verdict, for the cold and the warm pass: data (batch + order) / step <= 1% for the mean micro-batch,
the worst global step (sum over its 64 micro-batches) and the worst single micro-batch.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import ctypes
import ctypes.util
import mmap
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from resilientjob.agent import _data_files
from resilientjob.agent.data import SampleOrder, TokenFileDataset
from resilientjob.agent.models import ModelConfig, ModelKind, builtin_model, lm_loss
from resilientjob.protocol.workload import TokenDtype

SEQ_LEN = 1024
MICRO = 8
GLOBAL_BATCH = 512
VOCAB = 8192
ORDER_SAMPLES = 100_000
RANDPERM_SAMPLES = 10_000_000
GOAL = 0.01
CHECK_TOKENS = _data_files.CHECK_CHUNKS * _data_files.CHECK_CHUNK_TOKENS


def _write_tokens(path: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    with path.open("wb") as out:
        for start in range(0, count, 1 << 24):  # in 32 MB pieces: no 200 MB array at once
            rng.integers(0, VOCAB, size=min(1 << 24, count - start), dtype=np.uint16).tofile(out)
        out.flush()
        os.fsync(out.fileno())  # dirty pages cannot be dropped


def _drop_page_cache(path: Path) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore on a fresh mapping; None where unavailable)."""
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    mapping = np.memmap(path, dtype=np.uint8, mode="r")
    vector = (ctypes.c_ubyte * pages)()
    result = libc.mincore(ctypes.c_void_p(mapping.ctypes.data), ctypes.c_size_t(size), vector)
    del mapping
    if result != 0:
        return None
    return sum(v & 1 for v in vector) / pages


def _step_time(runs: int) -> float:
    """Median seconds of one micro-batch's forward + backward through the small GPT, on one thread."""
    config = ModelConfig(kind=ModelKind.GPT, layers=4, hidden=128, heads=4, seq_len=SEQ_LEN, vocab=VOCAB)
    spec = builtin_model(config)
    model = torch.nn.Sequential(*(spec.layer(index) for index in range(spec.num_layers)))
    tokens = torch.randint(VOCAB, (MICRO, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times = []
    for _ in range(runs + 1):  # the first run warms the allocator and is not counted
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        lm_loss(model(inputs), targets).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _data_pass(dataset: TokenFileDataset, order: SampleOrder, steps: int) -> list[float]:
    """Seconds of each `batch()` call over `steps` global steps' micro-batches (ids computed outside)."""
    per_step = GLOBAL_BATCH // MICRO
    times = []
    for step in range(steps):
        for micro in range(per_step):
            ids = order.microbatch_ids(step, micro, MICRO)
            start = time.perf_counter()
            inputs, targets = dataset.batch(ids)
            times.append(time.perf_counter() - start)
            if inputs.shape != (MICRO, SEQ_LEN) or targets.shape != (MICRO, SEQ_LEN):
                raise SystemExit(f"bad batch shape {tuple(inputs.shape)}")
    return times


def _order_times(steps: int, num_samples: int) -> list[float]:
    """Seconds of each `microbatch_ids` call for a data set of `num_samples`, from two steps before an
    epoch ends."""
    order = SampleOrder(num_samples, GLOBAL_BATCH, seed=1)
    per_step = GLOBAL_BATCH // MICRO
    first_step = max(0, num_samples // GLOBAL_BATCH - 2)
    times: list[float] = []
    for step in range(first_step, first_step + steps):
        for micro in range(per_step):
            start = time.perf_counter()
            order.microbatch_ids(step, micro, MICRO)
            times.append(time.perf_counter() - start)
    return times


def _randperm_draw(num_samples: int) -> tuple[float, int]:
    """The order before `EpochShuffle`: an epoch's permutation of all ids, as drawn (seconds, bytes)."""
    start = time.perf_counter()
    drawn = torch.randperm(num_samples, generator=torch.Generator().manual_seed(1), device="cpu")
    return time.perf_counter() - start, drawn.numel() * drawn.element_size()


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20M tokens, fewer steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    count = 20_000_000 if args.quick else 100_000_000
    cold_steps, warm_steps, order_steps = (4, 8, 8) if args.quick else (16, 32, 32)
    step_runs = 1 if args.quick else 2

    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch threads 1")
    with tempfile.TemporaryDirectory(prefix="rjob-bench-data-") as directory:
        path = Path(directory) / "tokens.uint16.bin"
        start = time.perf_counter()
        _write_tokens(path, count)
        print(
            f"tokens file: {count:,} uint16 tokens ({path.stat().st_size / 2**20:,.0f} MiB), written in "
            f"{time.perf_counter() - start:.1f} s"
        )
        dropped = _drop_page_cache(path)
        resident = _resident_fraction(path)
        shown = "unknown" if resident is None else f"{resident:.1%}"
        print(f"page cache dropped: {'yes' if dropped else 'no'} (resident after the drop: {shown})")

        # As `open_dataset` does at start-up: open, then the sampled vocabulary check, on the cold file.
        start = time.perf_counter()
        dataset = TokenFileDataset(path, TokenDtype.UINT16, SEQ_LEN, seed=0, vocab=VOCAB)
        dataset.check_vocab(VOCAB)
        print(
            f"open + check_vocab (cold, {CHECK_TOKENS:,} tokens sampled): {_ms(time.perf_counter() - start)}"
        )
        order = SampleOrder(dataset.num_samples, GLOBAL_BATCH, seed=0)
        print(
            f"data set: {dataset.num_samples:,} samples of {SEQ_LEN}; micro-batch {MICRO}, "
            f"global batch {GLOBAL_BATCH}"
        )
        cold = _data_pass(dataset, order, cold_steps)
        resident = _resident_fraction(path)
        with path.open("rb") as whole:  # the whole file into the page cache, as after a long run
            while whole.read(1 << 24):
                pass
        warm = _data_pass(dataset, order, warm_steps)
        del dataset
    shown = "unknown" if resident is None else f"{resident:.2%}"
    print(f"cold pass read {len(cold)} micro-batches (file resident afterwards: {shown})")

    order_small = _order_times(order_steps, ORDER_SAMPLES)
    order_huge = _order_times(order_steps, 2**40)
    drawn_s, drawn_bytes = _randperm_draw(RANDPERM_SAMPLES)
    step = _step_time(step_runs)

    rows = [
        ("batch(), cold page cache", cold),
        ("batch(), warm page cache", warm),
        ("microbatch_ids (100k samples)", order_small),
        ("microbatch_ids (2^40 samples)", order_huge),
    ]
    print()
    print(f"{'per micro-batch':<50} {'calls':>6} {'median':>12} {'p99':>12} {'max':>12}")
    for label, times in rows:
        print(
            f"{label:<50} {len(times):>6} {_us(statistics.median(times)):>12} "
            f"{_us(float(np.percentile(times, 99))):>12} {_us(max(times)):>12}"
        )
    print(f"{'forward + backward, GPT 4 layers, 1 thread':<50} {step_runs:>6} {_us(step):>12}")

    print(
        f"{'the order it replaced: randperm of 10M ids, per epoch':<50} {1:>6} {_us(drawn_s):>12} "
        f"({drawn_bytes / 2**20:,.0f} MiB held per worker; 2^40 ids would be {2**40 * 8 / 2**40:.0f} TiB)"
    )
    per_step = GLOBAL_BATCH // MICRO
    order = order_small + order_huge
    order_mean = statistics.mean(order)
    order_worst_step = max(sum(order[i : i + per_step]) for i in range(0, len(order), per_step))
    print(f"step = one micro-batch's forward + backward ({step:.3f} s); a global step has {per_step} of them")
    ok = True
    for label, times in (("cold", cold), ("warm", warm)):
        steps = [sum(times[i : i + per_step]) for i in range(0, len(times), per_step)]
        ratios = {
            "mean micro-batch": (statistics.mean(times) + order_mean) / step,
            "worst global step": (max(steps) + order_worst_step) / (per_step * step),
            "worst micro-batch": (max(times) + max(order)) / step,
        }
        passed = all(ratio <= GOAL for ratio in ratios.values())
        ok = ok and passed
        shown = ", ".join(f"{name} {ratio:.4%}" for name, ratio in ratios.items())
        print(f"data / step, {label}: {shown} (goal <= {GOAL:.0%}): {'PASS' if passed else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
