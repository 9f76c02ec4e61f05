"""The plan as people and checks read it: `format_plan`, the table `rlpipe plan` prints, and `limit_checks`, one
(check, passed, reason) line per limit, what `rlpipe rehearse` prints for the plan."""

from __future__ import annotations

from typing import NamedTuple

from rlpipe.plan.parts import GIB, Peak, SidePlan


class LimitCheck(NamedTuple):
    """One limit of the plan: `passed` None where there is nothing here to check it against (`reason` says why)."""

    name: str
    passed: bool | None
    reason: str


def limit_checks(result) -> list[LimitCheck]:
    """Every limit a memory plan (`rlpipe.plan.MemoryPlan`) checks, in the order a start meets them: the
    slices' chip counts and layout, the chips' HBM, the learner's load, each host's pod memory and /dev/shm."""
    checks = [LimitCheck("slices and chip counts", False, problem) for problem in result.problems]
    if not result.problems:
        checks.append(LimitCheck("slices and chip counts", True, "every role fills its chips in blocks TPUs start"))
    for side in (result.learner, result.rollout):
        name = f"{side.role} HBM per chip"
        if side.fits is None:
            checks.append(LimitCheck(name, None, f"no placement.{side.role}.tpu"))
        else:
            usable = side.usable_bytes / GIB
            verdict = "fits" if side.fits else f"over by {side.total_gib - usable:.2f} GiB"
            checks.append(LimitCheck(name, side.fits, f"{side.total_gib:.2f} of {usable:.2f} GiB usable: {verdict}"))
    for peak in result.peaks:
        if peak.fits is None:
            checks.append(LimitCheck(peak.name, None, peak.missing or "nothing to compare against"))
        else:
            verdict = "fits" if peak.fits else f"over by {peak.over_gib:.2f} GiB"
            checks.append(LimitCheck(peak.name, peak.fits, f"{peak.total_gib:.2f} of {peak.limit_label}: {verdict}"))
    return checks


def _side_lines(side: SidePlan, width: int) -> list[str]:
    share = side.share
    where = " (no TPU slice)"
    if share is not None:
        last = share.first_chip + share.chips - 1
        chips = f"chips {share.first_chip}-{last}" if share.shared else f"{share.chips} chips"
        where = f" on {share.tslice.pod_type} ({chips} x {share.tslice.hbm_gib} GiB HBM)"
    lines = [f"{side.role}{where}: {side.summary}"]
    lines += [f"  {part.label:<{width}} {part.gib:9.2f}" for part in side.parts]
    total = f"  {'total per chip':<{width}} {side.total_gib:9.2f}"
    if side.fits is None:
        lines.append(total)
    else:
        usable = side.usable_bytes / GIB
        verdict = "fits" if side.fits else f"DOES NOT FIT (over by {side.total_gib - usable:.2f} GiB)"
        share = f"{side.usable_fraction:.0%} of {side.slice.hbm_gib}"
        lines.append(f"{total}  of {usable:.2f} usable ({share}): {verdict}")
    return lines


def _peak_lines(peak: Peak, width: int) -> list[str]:
    lines = [peak.title]
    lines += [f"  {part.label:<{width}} {part.gib:9.2f}" for part in peak.parts]
    total = f"  {'peak' if peak.largest_part else 'total':<{width}} {peak.total_gib:9.2f}"
    if peak.fits is None:
        lines.append(total)
    else:
        verdict = "fits" if peak.fits else f"DOES NOT FIT (over by {peak.over_gib:.2f} GiB)"
        lines.append(f"{total}  of {peak.limit_label}: {verdict}")
    return lines


def format_plan(result: MemoryPlan) -> str:
    parts = [part for side in (result.learner, result.rollout) for part in side.parts]
    parts += [part for peak in result.peaks for part in peak.parts]
    width = max(max(len(part.label) for part in parts), len("total per chip"))
    lines = [
        f"model {result.model.name} ({result.model.model_type}, from {result.source}): {result.model.describe()}",
        f"{'memory per chip (host RAM: per host)':<{width + 2}} {'GiB':>9}",
        *_side_lines(result.learner, width),
        *_side_lines(result.rollout, width),
    ]
    for peak in result.peaks:
        lines += _peak_lines(peak, width)
    if result.problems:
        lines.append("problems:")
        lines += [f"  - {problem}" for problem in result.problems]
    if result.notes:
        lines.append("notes:")
        lines += [f"  - {note}" for note in result.notes]
    failing = [side.role for side in (result.learner, result.rollout) if side.fits is False]
    if result.ok:
        lines.append("plan: OK")
    else:
        why = [f"{role} does not fit" for role in failing]
        why += [
            f"{peak.name} over by {peak.over_gib:.2f} GiB" for peak in result.peaks if peak.fits is False
        ]
        why += ["see problems"] if result.problems else []
        lines.append(f"plan: NOT OK ({'; '.join(why)})")
    return "\n".join(lines)
