"""A checkpoint folder's manifest: every file with its size and CRC-32, and the check against it.

``manifest.json`` is written last into a training checkpoint (``step_<n>/``, over both models'
folders) and into every model checkpoint cooper_mcore saves (``cooper convert hf-to-mcore``,
SFT's output, a VerifyRM's ``final``): a folder with a manifest that verifies is whole.

Checksum: CRC-32 (``zlib``, standard library). It catches every truncation and every burst error up
to 32 bits, which is what torn writes and storage faults produce; it is not meant to resist
tampering (checkpoints are trusted files). Files are hashed in pieces of :data:`PIECE_BYTES` on
parallel threads (zlib releases the GIL) and the pieces' CRCs combined (:func:`crc32_combine`), so a
checkpoint of two 70 GB shards is not read by two threads only; a verification can also split the
pieces over the processes of a job (``rank``/``world``/``gather`` of :func:`verify_checkpoint`).

Standard library only: the checkpoint formats (:mod:`~cooper_mcore.checkpoint.model`,
:mod:`~cooper_mcore.checkpoint.training`) and their collectives use it.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from cooper_mcore.atomic import atomic_open

MANIFEST = "manifest.json"
#: a checkpoint's files are hashed in pieces of this size, each on a thread (and, verifying, on a rank)
PIECE_BYTES = 128 << 20
_READ_BYTES = 8 << 20
_THREADS = 8
_STEP_RE = re.compile(r"^step_(\d+)$")
#: what one process found: the first problem (None: none) and the CRC-32 of each piece it hashed, by index
Partial = tuple[Optional[str], dict[int, int]]


@dataclass(frozen=True)
class _Piece:
    """``length`` bytes of the file ``rel`` from ``offset``."""

    rel: str
    offset: int
    length: int


# --------------------------------------------------------------------------- CRC-32 of pieces


def _times(matrix: list[int], vector: int) -> int:
    """A GF(2) 32x32 matrix (a list of columns) times a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


#: the reflected CRC-32 register after one more zero bit (its polynomial 0xEDB88320), as a matrix
_ONE_ZERO_BIT = [0xEDB88320] + [1 << i for i in range(31)]


@lru_cache(maxsize=64)
def _zero_bytes_operator(length: int) -> tuple[int, ...]:
    """The matrix that moves a CRC-32 register over ``length`` zero bytes (cached: a checkpoint's
    pieces have one length, but the last of each file)."""
    result: Optional[list[int]] = None
    power = _square(_square(_square(_ONE_ZERO_BIT)))  # one zero byte
    while length:
        if length & 1:
            result = power if result is None else [_times(power, c) for c in result]
        length >>= 1
        if length:
            power = _square(power)
    return tuple(result if result is not None else [1 << i for i in range(32)])


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``length2 = len(B)``
    (what zlib's C ``crc32_combine`` computes; Python's zlib lacks it)."""
    return _times(list(_zero_bytes_operator(length2)), crc1) ^ crc2 if length2 else crc1


def _pieces(sizes: dict[str, int]) -> list[_Piece]:
    """The pieces of files of these sizes (one empty piece for an empty file), in file order."""
    out = []
    for rel, size in sizes.items():
        out.extend(_Piece(rel, off, min(PIECE_BYTES, size - off)) for off in range(0, size, PIECE_BYTES))
        if size == 0:
            out.append(_Piece(rel, 0, 0))
    return out


def _crc_piece(folder: str, piece: _Piece) -> int:
    crc, left = 0, piece.length
    with open(os.path.join(folder, piece.rel), "rb") as f:
        f.seek(piece.offset)
        while left and (chunk := f.read(min(_READ_BYTES, left))):
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    if left:
        raise OSError(f"{piece.rel} ended {left} bytes early while it was read")
    return crc


def _crc_pieces(folder: str, pieces: list[_Piece]) -> list[int]:
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(pieces)))) as pool:
        return list(pool.map(lambda p: _crc_piece(folder, p), pieces))


def _file_crcs(pieces: list[_Piece], crcs: dict[int, int]) -> dict[str, int]:
    """Every file's CRC-32, combined from its pieces' (``crcs`` by piece index)."""
    out: dict[str, int] = {}
    for i, p in enumerate(pieces):
        out[p.rel] = crc32_combine(out[p.rel], crcs[i], p.length) if p.rel in out else crcs[i]
    return out


# --------------------------------------------------------------------------- writing and checking


def _files(folder: str) -> list[str]:
    """Every regular file under ``folder`` except the manifest, as sorted relative paths."""
    out = []
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str) -> dict[str, Any]:
    """Write ``<folder>/manifest.json`` listing every other file with its size and CRC-32.

    Written to a temporary name, fsynced and renamed, so a manifest that exists is whole.

    Returns:
        The manifest.
    """
    sizes = {r: os.path.getsize(os.path.join(folder, r)) for r in _files(folder)}
    pieces = _pieces(sizes)
    crcs = _file_crcs(pieces, dict(enumerate(_crc_pieces(folder, pieces))))
    manifest = {"format": 1, "checksum": "crc32",
                "files": {r: {"size": size, "crc32": f"{crcs[r]:08x}"} for r, size in sizes.items()}}
    with atomic_open(os.path.join(folder, MANIFEST), fsync=True) as f:
        json.dump(manifest, f, indent=0)
    return manifest


def _listed(path: str, under: str) -> tuple[Optional[str], dict[str, int], dict[str, str]]:
    """The manifest's files (all, or those under ``under/``): ``(problem, sizes, CRC-32s)``."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        return f"no {MANIFEST} (a partial checkpoint)", {}, {}
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
        rels = sorted(r for r in files if not under or r.startswith(under + "/"))
        sizes = {r: int(files[r]["size"]) for r in rels}
        crcs = {r: str(files[r]["crc32"]) for r in rels}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MANIFEST}: {e}", {}, {}
    if under and not rels:
        return f"its {MANIFEST} lists no file of {under}/", {}, {}
    for r in rels:
        full = os.path.join(path, r)
        if not os.path.isfile(full):
            return f"{r} is missing", {}, {}
        if os.path.getsize(full) != sizes[r]:
            return f"{r} has {os.path.getsize(full)} bytes, the manifest says {sizes[r]}", {}, {}
    return None, sizes, crcs


def verify_checkpoint(path: str, under: str = "", rank: int = 0, world: int = 1,
                      gather: Optional[Callable[[Partial], list[Partial]]] = None) -> Optional[str]:
    """Check ``path`` against its manifest; return None when whole, else the first problem found.

    Sizes are checked for every file before any checksum is computed, so a truncated file is
    reported without reading the rest.

    Args:
        path: the folder holding ``manifest.json``.
        under: check only the files under this subfolder (a model's folder in a training checkpoint).
        rank / world: this process hashes the pieces ``rank, rank + world, ...`` (the others theirs).
        gather: with ``world > 1``, every process's :data:`Partial` in rank order (a collective
            every process calls once, whatever it found); the result is then the same on all.
    """
    problem, sizes, want = _listed(path, under)
    pieces = _pieces(sizes)
    mine = list(range(rank, len(pieces), world)) if problem is None else []
    crcs: dict[int, int] = {}
    try:
        crcs = dict(zip(mine, _crc_pieces(path, [pieces[i] for i in mine])))
    except OSError as e:
        problem = f"cannot read a file: {e}"
    if gather is not None:
        partials = gather((problem, crcs))
        problem = next((p for p, _ in partials if p is not None), None)
        crcs = {i: c for _, part in partials for i, c in part.items()}
    if problem is not None:
        return problem
    got = _file_crcs(pieces, crcs)
    for r in sizes:
        if f"{got[r]:08x}" != want[r]:
            return f"{r} has CRC-32 {got[r]:08x}, the manifest says {want[r]}"
    return None


def step_folders(out_dir: str) -> list[int]:
    """Steps of the ``step_<n>`` folders in ``out_dir`` (complete or not; ``*.tmp`` ignored), ascending."""
    if not os.path.isdir(out_dir):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(out_dir))
                  if m and os.path.isdir(os.path.join(out_dir, m.group(0))))


def complete_checkpoints(out_dir: str) -> list[int]:
    """Steps of the checkpoints in ``out_dir`` that have a manifest (not verified; ``*.tmp`` ignored)."""
    return [s for s in step_folders(out_dir) if os.path.isfile(os.path.join(out_dir, f"step_{s}", MANIFEST))]
