"""Timing models in onnxruntime: is the optimized model faster than the original, beyond noise?

Both models run in one process on the same inputs, with the same thread count and the
optimization level the user states, interleaved round by round (original, optimized,
original, ...) so that the machine's drift hits both alike. Each round gives one ratio
optimized/original; the reported ratio is the median of those, and the noise is half the
spread between their 25th and 75th percentiles, so "slower beyond noise" means the median
ratio exceeds 1 by more than that spread (and by at least MIN_NOISE: two timings of the same
model are never closer than that on a shared machine).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

LEVELS = ("off", "basic", "extended", "all")
MIN_NOISE = 0.02


@dataclass
class Timing:
    """Median latencies (ms), their ratio optimized/original, and the measured noise."""

    original_ms: float
    optimized_ms: float
    ratio: float
    noise: float
    rounds: int
    threads: int
    level: str

    @property
    def slower(self) -> bool:
        """The optimized model is slower than the original beyond the noise measured."""
        return self.ratio > 1 + self.noise

    def summary(self) -> str:
        change = "slower" if self.ratio > 1 else "faster"
        return (
            f"latency {self.original_ms:.3f} ms -> {self.optimized_ms:.3f} ms ({self.ratio:.2f}x, "
            f"{abs(1 - self.ratio) * 100:.1f}% {change}; noise {self.noise * 100:.1f}%), onnxruntime CPU, "
            f"{self.threads} thread{'s' if self.threads != 1 else ''}, optimizations {self.level}, {self.rounds} rounds"
        )

    def to_dict(self) -> dict:
        return {
            "original_ms": self.original_ms,
            "optimized_ms": self.optimized_ms,
            "ratio": self.ratio,
            "noise": self.noise,
            "slower": self.slower,
            "rounds": self.rounds,
            "threads": self.threads,
            "level": self.level,
        }


def session(model: onnx.ModelProto, level: str = "all", threads: int = 1, base_dir=None):
    """An onnxruntime CPU session at one of LEVELS with a fixed intra-op thread count; external
    data is read from `base_dir`, the model's folder.

    Its threads do not spin waiting for work. Timed round by round against another session,
    a session's spinning threads take the cores the other one runs on: three 2-thread sessions
    of a Llama export, interleaved on 2 cores, ran in 38 ms each instead of 17.5 ms, and their
    ratios moved by up to 20% from run to run (bench/transformers.py's tables had the same noise)."""
    import onnxruntime as ort

    from fuser import verify

    levels = {
        "off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if level not in levels:
        raise ValueError(f"optimization level must be one of {', '.join(LEVELS)}, not '{level}'")
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[level]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = verify.LOG_SEVERITY  # kept off the terminal, as the check's are
    return verify.open_session(model, options, base_dir)


def interleaved_ms(
    sessions: list, feeds: dict[str, np.ndarray], *, seconds: float = 3.0, min_rounds: int = 5, max_rounds: int = 1000
) -> list[list[float]]:
    """Per-session latencies (ms), one run of each session per round, for about `seconds`."""
    for sess in sessions:  # warm-up: first runs allocate and pick kernels
        sess.run(None, feeds)
        sess.run(None, feeds)
    samples: list[list[float]] = [[] for _ in sessions]
    started = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - started < seconds):
        for index, sess in enumerate(sessions):
            begin = time.perf_counter()
            sess.run(None, feeds)
            samples[index].append((time.perf_counter() - begin) * 1000)
        rounds += 1
    return samples


def compare(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    *,
    level: str = "all",
    threads: int = 1,
    seconds: float = 3.0,
    progress: Callable[[str], None] | None = None,
    base_dir=None,
) -> Timing:
    """Time `optimized` against `original` (see the module docstring); external data of either
    is read from `base_dir`."""
    if progress:
        progress(f"timing the original and the optimized model ({seconds:g} s, optimizations {level})")
    sessions = [session(original, level, threads, base_dir), session(optimized, level, threads, base_dir)]
    before, after = interleaved_ms(sessions, feeds, seconds=seconds)
    ratios = sorted(a / b for a, b in zip(after, before))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [ratios[0], 0, ratios[-1]]
    median_ratio = statistics.median(ratios)
    noise = max(MIN_NOISE, (quartiles[2] - quartiles[0]) / 2 / median_ratio)
    return Timing(
        original_ms=statistics.median(before),
        optimized_ms=statistics.median(after),
        ratio=median_ratio,
        noise=noise,
        rounds=len(ratios),
        threads=threads,
        level=level,
    )


def paying_rules(
    original: onnx.ModelProto,
    rules: list,
    feeds: dict[str, np.ndarray],
    *,
    base_dir=None,
    level: str = "all",
    threads: int = 1,
    seconds: float = 2.0,
    progress: Callable[[str], None] | None = None,
    context=None,
) -> tuple[list, list[str]]:
    """The rules of every phase whose output is not slower than its input beyond noise, and a
    note for each phase left out.

    Phases are tried in order, each on top of the phases kept before it: the model with
    phases up to p is timed against the model with the kept phases before p.
    """
    from fuser.engine import Engine
    from fuser.model import Model

    kept: list[int] = []
    previous = original
    notes = []
    for phase in sorted({r.phase for r in rules}):
        trial = [r for r in rules if r.phase in kept or r.phase == phase]
        model = Model(onnx.ModelProto.FromString(original.SerializeToString()), base_dir=base_dir)
        result = Engine(model, trial, context=context).run()
        applied = sorted({r.rule for r in result.rewrites} & {r.name for r in rules if r.phase == phase})
        if not applied:
            kept.append(phase)
            continue
        candidate = model.to_proto(in_place=True)
        timing = compare(
            previous,
            candidate,
            feeds,
            level=level,
            threads=threads,
            seconds=seconds,
            progress=progress,
            base_dir=base_dir,
        )
        if timing.slower:
            notes.append(f"--measure: left out the phase-{phase} rules ({', '.join(applied)}): {timing.summary()}")
        else:
            kept.append(phase)
            previous = candidate
    return [r for r in rules if r.phase in kept], notes
