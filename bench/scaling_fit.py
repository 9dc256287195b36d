"""``bench/scaling``'s power-law fits: ``y = c * x ** b`` by least squares in log-log space."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def power_law(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float | None]:
    """``y = coefficient * x ** exponent`` by least squares on the logs; the last segment's slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    exponent = sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / sxx
    intercept = my - exponent * mx
    residual = sum((y - intercept - exponent * x) ** 2 for x, y in zip(lx, ly, strict=True))
    total = sum((y - my) ** 2 for y in ly)
    return {
        "exponent": exponent,
        "coefficient": math.exp(intercept),
        "r2": 1 - residual / total if total > 0 and len(xs) > 2 else None,
        "last_segment_exponent": (ly[-1] - ly[-2]) / (lx[-1] - lx[-2]),
        "points": len(xs),
    }


def fits(points: Sequence[dict[str, Any]], floor: int) -> dict[str, Any]:
    """An axis's fits: step seconds, peak RSS and the peak above ``floor`` per Python process
    (where every point has a peak), and the step seconds of the measured points alone (where
    some are modelled)."""
    usable = [p for p in points if p.get("peak_rss_bytes")]
    xs = [p["x"] for p in points]
    out: dict[str, Any] = {"step_seconds": power_law(xs, [p["step_seconds"] for p in points])}
    if len(usable) >= 2:
        ux = [p["x"] for p in usable]
        out["peak_rss"] = power_law(ux, [p["peak_rss_bytes"] for p in usable])
        above = [p["peak_rss_bytes"] - floor * p["python_processes"] for p in usable]
        if all(a > 0 for a in above):
            out["peak_rss_above_floor"] = power_law(ux, above)
    measured = [p for p in points if p["kind"] == "measured"]
    if len(measured) != len(points) and len(measured) >= 2:
        out["step_seconds_measured_only"] = power_law(
            [p["x"] for p in measured], [p["step_seconds"] for p in measured]
        )
    return out
