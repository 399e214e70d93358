"""What verifying a checkpoint against its manifest costs: CRC-32 of every file, in pieces on threads.

Writes ``--files`` files of random bytes (``--gib`` GiB in all, like a checkpoint's ``.distcp``
shards) into a temporary folder, writes their manifest, then verifies it with 1, 2 and 8 threads
(:data:`cooper_mcore.checkpoint.manifest._THREADS`), and once the way verification worked before
pieces (one thread per whole file). The files were just written, so they are read from the page
cache: this is the checksum's cost, not the storage's (a cold read is bounded by the disk or the
network file system, which then dominates).

    python benchmarks/checkpoint_verify.py [--gib 2] [--files 2] [--dir /tmp]

Prints a table and, as its last line, ``gb_per_s_1thread=<float> gb_per_s_8threads=<float> ...``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib

from cooper_mcore.checkpoint import manifest


def _write(folder: str, files: int, total: int) -> None:
    block = os.urandom(64 << 20)
    for i in range(files):
        with open(os.path.join(folder, f"__0_{i}.distcp"), "wb") as f:
            left = total // files
            while left > 0:
                f.write(block[:left])
                left -= len(block)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="total size of the files, GiB")
    parser.add_argument("--files", type=int, default=2, help="number of files (shards)")
    parser.add_argument("--dir", default=None, help="where to write them (default the system's temporary folder)")
    args = parser.parse_args()
    total = int(args.gib * 2**30)
    result = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        _write(folder, args.files, total)
        buf = os.urandom(256 << 20)
        result["memory_1thread"] = len(buf) / _timed(lambda: zlib.crc32(buf)) / 1e9
        result["write_manifest_8threads"] = total / _timed(lambda: manifest.write_manifest(folder)) / 1e9
        for threads in (1, 2, 8):
            manifest._THREADS = threads
            seconds = _timed(lambda: manifest.verify_checkpoint(folder))
            result[f"verify_{threads}thread{'s' if threads > 1 else ''}"] = total / seconds / 1e9
        manifest._THREADS, manifest.PIECE_BYTES = 8, 2**62  # one piece per file: a thread per file
        result["verify_whole_files"] = total / _timed(lambda: manifest.verify_checkpoint(folder)) / 1e9
    print(f"{args.gib:g} GiB in {args.files} files, {os.cpu_count()} CPUs, files in the page cache")
    for name, rate in result.items():
        print(f"{name:26s} {rate:6.2f} GB/s   {total / 1e9 / rate:6.2f} s for {args.gib:g} GiB")
    print(" ".join(f"gb_per_s_{k}={v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
