"""Rule-based answer verifier over math-verify, with a hard per-item timeout.

``RuleVerifier`` checks a prediction against a gold answer with ``math_verify.parse``/``verify`` (gold
first: ``verify`` is not symmetric). Both strings may be full texts or bare answers:

* ``pred`` is the full completion of the policy. If it contains ``\\boxed{...}``, math-verify extracts
  the boxed answer itself (several boxes form a set, as math-verify does). Otherwise, or if that yields
  nothing, :func:`extract_answer` finds the final answer (GSM8K ``#### 72``, ``The answer is 42.``, the
  last math environment, the last number, or the whole text when it is a bare answer like ``1/2``),
  which is wrapped in ``$...$`` for math-verify. No answer at all is a wrong answer; so is an answer
  math-verify keeps only as a string (``\\boxed{14.}`` parses to ``['14.']``, no value), and the
  outcome's ``answered`` (False for both) tells such a "no readable answer" from a different answer.
* ``gold`` is handled the same way, so a bare ``\\frac{1}{2}``, a GSM8K solution ending in ``#### 72``
  and a MATH solution with ``\\boxed{}`` all work. A gold the checker cannot read as a value (none
  parseable, one math-verify keeps only as a string such as ``\\boxed{14.}``, a number written in words
  such as ``fourteen``, which math-verify reads as a product of the letters as variables) is still put
  to math-verify, on the checker's parses and on math-verify's own reading of the two texts: where it
  matches the pair (the same string ``\\boxed{14.}``; ``x = \\frac{1}{2}, x = ...`` boxed alike) the
  answer is right; otherwise the item is unverifiable (``correct=None``, status ``"gold_unreadable"``),
  never a confident wrong: math-verify's "no" against such a gold says nothing (``fourteen`` against a
  correct ``\\boxed{14}`` is "no"), and every completion would be scored wrong against it.

math-verify's own timeouts (``signal.alarm``) are disabled: they do not stop sympy inside C code and
fail outside the main thread. Instead every item runs in a pool of long-lived worker processes (one
item at a time per worker); the parent holds a deadline per in-flight item and on expiry SIGKILLs the
worker and starts a fresh one. A timeout or crash marks that item unverifiable (``correct=None``) and is
counted in :attr:`RuleVerifier.stats` (as is an unreadable gold); it never raises to the caller or hangs.
Workers come from the "forkserver" context by default (a clean server process that preloads math-verify, safe in a
multi-threaded trainer); as with "spawn", a script that uses the verifier needs an
``if __name__ == "__main__":`` guard. Each worker also caps its address space (``memory_limit_mb``
above its start size) so that a runaway sympy computation fails instead of swapping the machine.

``verify_jsonl`` is the body of ``cooper verify --in F.jsonl --out G.jsonl``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import re
import resource
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from cooper_mcore.atomic import atomic_open, check_output_path
from cooper_mcore.verify.extract import extract_answer

__all__ = ["GOLD_UNREADABLE", "RuleVerifier", "VerifyOutcome", "check_pair", "extract_answer", "gold_readable",
           "verify_jsonl"]

logger = logging.getLogger(__name__)

_BOXED = "\\boxed"
_MAX_START_FAILURES = 3
_ERROR_CHARS = 300
#: the status of an item whose gold answer the checker cannot read (the item is unverifiable)
GOLD_UNREADABLE = "gold_unreadable"
_NUMBER_WORD = (r"zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|"
                r"sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|"
                r"hundred|thousand|million|billion|and|minus|negative")
#: a number written in English words (``fourteen``, ``twenty-one``, ``one hundred and five``), bare or in
#: ``\\text{}`` / ``\\mathrm{}``: math-verify reads it as a product of its letters as variables
_NUMBER_IN_WORDS = re.compile(rf"^(?:\\(?:text|mathrm)\{{)?\s*(?:{_NUMBER_WORD})(?:[\s-]+(?:{_NUMBER_WORD}))*\s*\}}?$",
                              re.IGNORECASE)
#: the name of a variable math-verify made of a number it did not read (``\\text{14}``, ``\\text{14.}``)
_NUMERIC_NAME = re.compile(r"-?\d")
#: math-verify's own reading of a text (:func:`_own_parse`)
_OWN_READING = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


@dataclass
class VerifyOutcome:
    """The verdict on one (gold, pred) pair.

    Attributes:
        correct: True/False, or None when unverifiable (timeout, worker crash, unreadable gold).
        seconds: Wall time from dispatch to a worker until the verdict (the timeout for timeouts).
        status: "ok" (a verdict), "timeout" (worker killed at the deadline), "gold_unreadable" (the
            gold has no answer the checker reads as a value, and math-verify did not match the pair:
            :data:`GOLD_UNREADABLE`) or "error".
        error: What went wrong when status is not "ok".
        answered: whether the completion has a final answer the checker reads as a value (a wrong
            verdict with ``answered`` False means "no readable answer", not "a different answer");
            None when unknown.
    """

    correct: Optional[bool]
    seconds: float
    status: str
    error: Optional[str] = None
    answered: Optional[bool] = None


# --------------------------------------------------------------------------- worker side


def _parse_answer(text: str) -> list:
    """math-verify's parse of the final answer of ``text`` ([] if none); runs inside a worker."""
    if _BOXED in text:
        parsed = parse(text, [LatexExtractionConfig(boxed_match_priority=0)], parsing_timeout=None)
        if parsed:
            return parsed
    ans = extract_answer(text)
    if ans is None:
        return []
    return parse(f"${ans}$", parsing_timeout=None)


def _reads_a_value(parsed: list) -> bool:
    """Whether a math-verify parse holds a math value (a sympy object, a number, a set), not only the
    raw strings it keeps for what it could not read (``['14.']`` for ``\\boxed{14.}``)."""
    return any(not isinstance(x, str) for x in parsed)


def gold_readable(parsed: list) -> bool:
    """Whether a gold answer's math-verify parse (:func:`_parse_answer`) is one the checker can judge
    against: it holds a math value (:func:`_reads_a_value`) and is not a number written in words.

    ``fourteen`` parses to the product of its letters as variables and ``\\text{14}`` to a variable named
    ``14``, which math-verify matches with ``14`` inside ``$...$`` but not with ``14.`` or ``0.5``: judging
    against them would call correct answers wrong, so such a gold is unreadable (:func:`check_pair` then
    takes only math-verify's matches, never its "no").
    Other words (``Monday``) stay readable: math-verify matches them as written.
    """
    if not _reads_a_value(parsed):
        return False
    if any(_NUMERIC_NAME.match(s.name) for x in parsed if not isinstance(x, str)
           for s in getattr(x, "free_symbols", ())):
        return False  # \\text{14} parses to a variable named "14", a name rather than a value
    text = next((x for x in reversed(parsed) if isinstance(x, str)), "")
    return not _NUMBER_IN_WORDS.match(text.strip())


def _own_parse(text: str) -> list:
    """math-verify's own reading of a whole text: its LaTeX extraction (boxed answers first) and its plain
    expressions, the configuration math-verify's test suite judges pairs with; runs inside a worker."""
    return parse(text, _OWN_READING, parsing_timeout=None)


def _math_verify_matches(gold: str, gold_parsed: list, pred: str, pred_parsed: list) -> bool:
    """Whether math-verify judges ``pred`` equal to a gold the checker cannot read: on the checker's parses
    (a gold it keeps only as a string matches the same string) or on its own readings of the two texts
    (:func:`_own_parse`), which may find a value the checker's extraction did not."""
    if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return True
    own_gold = _own_parse(gold)
    return bool(own_gold) and bool(verify(own_gold, _own_parse(pred), timeout_seconds=None))


def check_pair(gold: str, pred: str) -> tuple[Optional[bool], str, Optional[str], Optional[bool]]:
    """Verify one pair in this process, without any timeout (the worker's job; also handy in tests).

    A gold the checker reads (:func:`gold_readable`) gives a verdict, right or wrong. A gold it cannot read
    (no parseable answer, strings only as ``\\boxed{14.}``, a number in words) is still put to math-verify,
    which can match a pair without reading a value (the same string, :func:`_math_verify_matches`): a match
    is a right answer; anything else is unverifiable, never a confident wrong, since math-verify's "no"
    against a gold it cannot read says nothing (``fourteen`` against a correct ``\\boxed{14}`` is "no").

    Args:
        gold: Reference answer or solution.
        pred: Completion or bare answer.

    Returns:
        (correct, status, error, answered): (verdict, "ok", None, answered) for a gold the checker reads;
        for one it cannot read, (True, "ok", None, True) when math-verify matches the pair, else
        (None, "gold_unreadable", why, None). A pred without a parseable answer is wrong against a readable
        gold. ``answered`` says whether math-verify read the pred's final answer as a math value (its parse
        holds a non-string element, e.g. ``[5, '5']``); False when the parse is empty or strings only
        (``['14.']`` for ``\\boxed{14.}``), so that a wrong verdict there means "no readable answer" rather
        than "a different answer".
    """
    gold_parsed = _parse_answer(gold)
    pred_parsed = _parse_answer(pred)
    if not gold_parsed or not gold_readable(gold_parsed):
        if _math_verify_matches(gold, gold_parsed, pred, pred_parsed):
            return True, "ok", None, True
        why = (f"gold has no answer math-verify reads as a value (parsed {gold_parsed!r})" if gold_parsed
               else "gold has no parseable answer")
        return None, GOLD_UNREADABLE, why, None
    if not pred_parsed:
        return False, "ok", None, False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None)), "ok", None, _reads_a_value(pred_parsed)


def _limit_memory(extra_mb: Optional[int]) -> None:
    """Cap this process's address space at its current size plus ``extra_mb`` (Linux; best effort)."""
    if not extra_mb:
        return
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        soft = vm_kb * 1024 + extra_mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (OSError, ValueError, StopIteration, ImportError):
        pass


def _worker_main(conn: Connection, memory_limit_mb: Optional[int]) -> None:
    """Worker loop: announce readiness, then answer (idx, gold, pred) requests with (idx, correct, status,
    error, answered) until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings
    _limit_memory(memory_limit_mb)
    check_pair("\\frac{1}{2}", "The answer is \\boxed{0.5}.")  # warm sympy/antlr before the first deadline
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, gold, pred = msg
        try:
            correct, status, error, answered = check_pair(gold, pred)
        except Exception as e:  # noqa: BLE001 - any failure is an unverifiable item, never a dead worker
            correct, status, error, answered = None, "error", f"{type(e).__name__}: {str(e)[:_ERROR_CHARS]}", None
        conn.send((idx, correct, status, error, answered))


# --------------------------------------------------------------------------- parent side


@dataclass
class _Worker:
    proc: Any  # a multiprocessing Process of the chosen context
    conn: Connection
    state: str  # "starting" | "idle" | "busy"
    deadline: float  # start deadline while starting, item deadline while busy
    item: int = -1
    dispatched: float = 0.0


def _reaped(proc: Any) -> bool:
    """Reap ``proc`` without blocking; True once it has exited."""
    proc.join(timeout=0)
    return proc.exitcode is not None


def _shutdown(workers: list[_Worker], killed: list[Any]) -> None:
    """Stop all workers: ask idle and starting ones to exit, SIGKILL busy ones and whatever is still alive
    after a second; reap killed ones."""
    for w in workers:
        if w.state == "busy":
            w.proc.kill()
            continue
        try:
            w.conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + 1.0
    for w in workers:
        w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5.0)
        w.conn.close()
    workers.clear()
    for proc in killed:
        proc.join(timeout=5.0)
    killed.clear()


class RuleVerifier:
    """Parallel math-verify checker with a hard per-item timeout in killable worker processes.

    Not for concurrent use from several threads (calls are serialized by a lock). Use as a context
    manager or call :meth:`close`; workers are also killed when the object is garbage collected.

    Args:
        timeout_s: Hard limit per item, from dispatch to verdict, in seconds.
        num_workers: Number of worker processes.
        start_method: multiprocessing start method: "forkserver" (default; sets the process-wide
            forkserver preload list to math-verify and this module), "spawn" or "fork" (unsafe in a
            multi-threaded parent).
        memory_limit_mb: Address-space headroom per worker above its start size; None for no cap.
        start_timeout_s: Limit for a worker to import math-verify and warm up.

    Raises:
        ValueError: If an argument is out of range.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        num_workers: int = 2,
        *,
        start_method: str = "forkserver",
        memory_limit_mb: Optional[int] = 4096,
        start_timeout_s: float = 120.0,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"RuleVerifier: timeout_s must be > 0, got {timeout_s}")
        if num_workers < 1:
            raise ValueError(f"RuleVerifier: num_workers must be >= 1, got {num_workers}")
        if start_method not in mp.get_all_start_methods():
            raise ValueError(f"RuleVerifier: start_method {start_method!r} not in {mp.get_all_start_methods()}")
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self._memory_limit_mb = memory_limit_mb
        self._start_timeout_s = float(start_timeout_s)
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(["math_verify", __name__])
        self._lock = threading.Lock()
        self._stats = {"total": 0, "correct": 0, "wrong": 0, "timeout": 0, "error": 0, GOLD_UNREADABLE: 0}
        self._start_failures = 0
        self._workers: list[_Worker] = []
        self._killed: list[Any] = []  # killed worker processes not reaped yet
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._killed)
        self._workers.extend(self._spawn() for _ in range(self.num_workers))

    # ------------------------------------------------------------------ public API

    @property
    def stats(self) -> dict[str, int]:
        """Cumulative counts over all calls: total, correct, wrong, timeout, error, gold_unreadable."""
        return dict(self._stats)

    def verify(self, gold: str, pred: str) -> VerifyOutcome:
        """Verify one completion against its gold answer.

        Args:
            gold: Reference answer (bare answer or solution text).
            pred: Full completion text (or a bare answer).

        Returns:
            The outcome; never raises for a timeout or a worker crash.
        """
        return self.verify_batch([gold], [pred])[0]

    def verify_batch(self, golds: Sequence[str], preds: Sequence[str]) -> list[VerifyOutcome]:
        """Verify many pairs in parallel across the workers.

        Args:
            golds: Reference answers.
            preds: Completions, aligned with ``golds``.

        Returns:
            One outcome per pair, in input order.

        Raises:
            ValueError: If the lengths differ, an element is not a string, or the verifier is closed.
        """
        if len(golds) != len(preds):
            raise ValueError(f"verify_batch: {len(golds)} golds but {len(preds)} preds")
        for name, seq in (("golds", golds), ("preds", preds)):
            for i, s in enumerate(seq):
                if not isinstance(s, str):
                    raise ValueError(f"verify_batch: {name}[{i}] is {type(s).__name__}, expected str")
        with self._lock:
            if not self._finalizer.alive:
                raise ValueError("RuleVerifier is closed")
            try:
                results = self._run(golds, preds)
            except BaseException:
                # Interrupted (e.g. KeyboardInterrupt): busy workers would answer stale items later.
                for i, w in enumerate(self._workers):
                    if w.state == "busy":
                        self._replace(i)
                raise
        bad = [o.status for o in results if o.status not in ("ok", GOLD_UNREADABLE)]
        if bad:  # an unreadable gold is the data's (counted by the caller), not the checker's failure
            logger.warning("verifier: %d of %d items unverifiable (%d timeouts, %d errors)", len(bad),
                           len(results), bad.count("timeout"), bad.count("error"))
        return results

    def close(self) -> None:
        """Stop the workers. Idempotent."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> RuleVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ pool management

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child_conn, self._memory_limit_mb),
                                 name="cooper-verifier", daemon=True)
        proc.start()
        child_conn.close()  # so that the parent sees EOF when the worker dies
        return _Worker(proc, parent_conn, "starting", time.monotonic() + self._start_timeout_s)

    def _replace(self, i: int) -> None:
        """SIGKILL worker ``i`` (if alive) and put a fresh one in its slot; the old one is reaped later."""
        w = self._workers[i]
        if w.proc.is_alive():
            w.proc.kill()
        w.conn.close()
        self._killed.append(w.proc)
        self._killed[:] = [p for p in self._killed if not _reaped(p)]
        self._workers[i] = self._spawn()

    def _start_failed(self, i: int, why: str) -> None:
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            raise RuntimeError(f"verifier workers fail to start ({why}); is math-verify importable?")
        logger.warning("verifier: worker failed to start (%s); retrying", why)
        self._replace(i)

    def _record(self, out: VerifyOutcome) -> VerifyOutcome:
        self._stats["total"] += 1
        if out.status == "ok" and out.correct is not None:
            self._stats["correct" if out.correct else "wrong"] += 1
        else:
            self._stats[out.status if out.status in ("timeout", GOLD_UNREADABLE) else "error"] += 1
        return out

    def _run(self, golds: Sequence[str], preds: Sequence[str]) -> list[VerifyOutcome]:
        """The dispatch loop: feed idle workers, collect verdicts, kill workers past their deadline."""
        results: list[Optional[VerifyOutcome]] = [None] * len(golds)
        pending = deque(range(len(golds)))
        workers = self._workers
        while True:
            for i, w in enumerate(workers):  # dispatch
                while w.state == "idle" and pending:
                    item = pending.popleft()
                    now = time.monotonic()
                    try:
                        w.conn.send((item, golds[item], preds[item]))
                    except OSError as e:  # died while idle
                        results[item] = self._record(VerifyOutcome(None, time.monotonic() - now, "error",
                                                                   f"worker died: {e}"))
                        self._replace(i)
                        w = workers[i]
                        break
                    w.state, w.item, w.dispatched, w.deadline = "busy", item, now, now + self.timeout_s
            active = [w for w in workers if w.state != "idle"]
            if not pending and not any(w.state == "busy" for w in workers):
                break
            assert active, "pending items but no busy or starting worker"
            wait_s = max(0.0, min(w.deadline for w in active) - time.monotonic())
            ready = set(wait([w.conn for w in active], timeout=wait_s))
            now = time.monotonic()
            for i, w in enumerate(workers):
                if w.state == "idle":
                    continue
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(timeout=1.0)
                        why = f"worker died (exit code {w.proc.exitcode})"
                        if w.state == "starting":
                            self._start_failed(i, why)
                        else:
                            results[w.item] = self._record(VerifyOutcome(None, now - w.dispatched, "error", why))
                            logger.debug("verifier: item %d: %s", w.item, why)
                            self._replace(i)
                        continue
                    if w.state == "starting":
                        assert msg[0] == "ready", f"unexpected first message from a worker: {msg!r}"
                        self._start_failures = 0
                        w.state = "idle"
                        continue
                    idx, correct, status, error, answered = msg
                    assert idx == w.item, f"worker answered item {idx}, expected {w.item}"
                    results[idx] = self._record(VerifyOutcome(correct, now - w.dispatched, status, error,
                                                              answered))
                    w.state, w.item = "idle", -1
                elif now >= w.deadline:
                    if w.state == "starting":
                        self._start_failed(i, f"not ready after {self._start_timeout_s:.0f} s")
                        continue
                    results[w.item] = self._record(
                        VerifyOutcome(None, now - w.dispatched, "timeout", f"no verdict in {self.timeout_s:g} s"))
                    logger.debug("verifier: item %d timed out; restarting its worker", w.item)
                    self._replace(i)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


# --------------------------------------------------------------------------- JSONL


def _read_jsonl(path: str, gold_key: str, pred_key: str) -> list[dict]:
    """Records of a JSONL file, each an object with string ``gold_key`` and ``pred_key``."""
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e.reason})") from None
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            for key in (gold_key, pred_key):
                if key not in rec:
                    raise ValueError(f"{where}: missing field {key!r}")
                if not isinstance(rec[key], str):
                    raise ValueError(f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}")
            records.append(rec)
    return records


def verify_jsonl(
    in_path: str,
    out_path: str,
    timeout_s: float = 5.0,
    num_workers: int = 2,
    gold_key: str = "gold",
    pred_key: str = "pred",
    chunk_size: int = 4096,
) -> dict:
    """Verify every line of a JSONL file and write the results (body of ``cooper verify``).

    Each input line is an object with string fields ``gold_key`` and ``pred_key`` (pred: a full
    completion or a bare answer). Each output line is that object plus ``correct`` (true, false, or
    null when unverifiable) and ``seconds``; existing fields of those names are overwritten. Blank
    lines are skipped. All lines are validated before any verification; the output is written to a
    temporary file in the output folder and renamed into place at the end
    (:func:`cooper_mcore.atomic.atomic_open`). An input without a single row is an error, not a
    score: there is nothing to verify, and no output is written.

    Args:
        in_path: Input JSONL file.
        out_path: Output JSONL file (replaced atomically if it exists; if it exists, it must be a
            regular file or a link to one).
        timeout_s: Hard per-item limit in seconds.
        num_workers: Worker processes.
        gold_key: Name of the gold field.
        pred_key: Name of the prediction field.
        chunk_size: Items per ``verify_batch`` call (progress is logged per chunk).

    Returns:
        Summary: total, correct, wrong, timeout, error, gold_unreadable, unverifiable (the three
        together), accuracy (correct / total),
        max_seconds, mean_seconds, wall_seconds, items_per_s, out.

    Raises:
        ValueError: On a malformed line (bad UTF-8 or JSON, not an object, missing or non-string
            field), naming the file and line number; an input without rows; an ``out_path`` that
            exists and is not a regular file (a device, a FIFO, a folder).
        FileNotFoundError: If ``in_path`` does not exist.
    """
    t0 = time.monotonic()
    check_output_path(out_path)
    records = _read_jsonl(in_path, gold_key, pred_key)
    if not records:
        raise ValueError(f"{in_path} has no rows to verify (it is empty or holds only blank lines); nothing was "
                         f"written to {out_path}")
    max_s = sum_s = 0.0
    with atomic_open(out_path) as f, RuleVerifier(timeout_s, num_workers) as verifier:
        for start in range(0, len(records), chunk_size):
            chunk = records[start : start + chunk_size]
            outcomes = verifier.verify_batch([r[gold_key] for r in chunk], [r[pred_key] for r in chunk])
            for rec, out in zip(chunk, outcomes):
                rec["correct"] = out.correct
                rec["seconds"] = round(out.seconds, 6)
                max_s, sum_s = max(max_s, out.seconds), sum_s + out.seconds
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            logger.info("verify: %d/%d items", start + len(chunk), len(records))
        stats = verifier.stats
    wall = time.monotonic() - t0
    total = stats["total"]
    return {
        **stats,
        "unverifiable": stats["timeout"] + stats["error"] + stats[GOLD_UNREADABLE],
        "accuracy": stats["correct"] / total,
        "max_seconds": round(max_s, 6),
        "mean_seconds": round(sum_s / total, 6),
        "wall_seconds": round(wall, 3),
        "items_per_s": round(total / wall, 1) if wall > 0 else 0.0,
        "out": out_path,
    }
