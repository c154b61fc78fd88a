"""``kernelbay explain MODEL``: the per-layer plan with every candidate's verdict."""

from __future__ import annotations

import json

from kernelbay._table import render_table
from kernelbay.plan import Decision, Plan, plan_checkpoint
from kernelbay.plugins import Registry
from kernelbay.policy import Policy
from kernelbay.trace import CandidateStatus, render_trace

__all__ = ["render_plan", "run_explain", "summary_lines"]


def _others(decision: Decision) -> str:
    # Only candidates meant for this kind of request: "handles nvfp4 only" is noise here.
    passed = [t for t in decision.trace
              if not t.chosen and t.status is not CandidateStatus.ACCEPTED and t.applicable]
    if not passed and decision.error:
        return decision.error.splitlines()[0]
    return "; ".join(f"{t.backend}: {t.reason}" for t in passed[:3])


def _section(title: str, decision: Decision, verbose: bool) -> list[str]:
    describe = getattr(decision.request, "describe", None)
    what = describe() if callable(describe) else ""
    lines = [f"{title}: {decision.chosen}" + (f"  [{what}]" if what else "")]
    if decision.trace and verbose:
        lines.append(render_trace(decision.trace))
    elif decision.selection is not None:
        passed = _others(decision)
        if passed:
            lines.append(f"  passed over: {passed}")
    else:
        lines.extend("  " + line for line in decision.error.splitlines())
    return lines


def summary_lines(plan: Plan) -> list[str]:
    """A compact plan: format, attention, collective, and each linear backend with its count."""
    lines = [f"  checkpoint format: {plan.format.chosen}",
             f"  attention: {plan.attention.chosen}"]
    if plan.collective is not None:
        lines.append(f"  collective: {plan.collective.chosen}")
    if plan.gemm_collective is not None:
        lines.append(f"  gemm + all-reduce: {plan.gemm_collective.chosen}")
    if plan.gather_collective is not None:
        lines.append(f"  all-gather: {plan.gather_collective.chosen}")
    if plan.proposer is not None:
        lines.append(f"  proposer: {plan.proposer.chosen}")
    counts: dict[str, int] = {}
    for d in plan.linears:
        counts[d.chosen] = counts.get(d.chosen, 0) + 1
    lines.append("  linear: " + ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())))
    return lines


def render_plan(plan: Plan, verbose: bool = False) -> str:
    """Terminal text of a plan: format, attention, collective, then grouped linear layers."""
    out = [f"checkpoint: {plan.checkpoint}", f"architecture: {plan.architecture}",
           f"device: {plan.device.describe()}" + (f", tp {plan.tp_size}"
                                                   if plan.tp_size > 1 else ""), ""]
    out += _section("checkpoint format", plan.format, verbose)
    out += _section("attention", plan.attention, verbose)
    if plan.collective is not None:
        out += _section("collective", plan.collective, verbose)
    if plan.gemm_collective is not None:
        out += _section("gemm + all-reduce", plan.gemm_collective, verbose)
    if plan.gather_collective is not None:
        out += _section("all-gather", plan.gather_collective, verbose)
    out.append("")
    rows = []
    for pattern, count, d in plan.groups():
        req = d.request
        shape = (f"{getattr(req, 'in_features', '?')}->{getattr(req, 'out_features', '?')}"
                 if req is not None else "-")
        scheme = getattr(getattr(req, "scheme", None), "name", "-")
        rows.append([pattern, str(count), shape, scheme, d.chosen, _others(d)])
    out.append(f"linear layers ({len(plan.linears)}):")
    out.append(render_table(["module", "n", "K->N", "scheme", "chosen", "passed over"], rows))
    if verbose:
        for pattern, _, d in plan.groups():
            if d.trace:
                out.append(f"\n{pattern}:")
                out.append(render_trace(d.trace))
    if not plan.ok:
        out.append("\nsome layers have no backend: see the reasons above")
    return "\n".join(out)


def run_explain(policy: Policy, model: str, *, tp_size: int, kv_cache: str, as_json: bool,
                verbose: bool) -> int:
    """Print the plan (or JSON); exit status 1 when some layer has no backend."""
    registry = Registry.discover(policy)
    plan = plan_checkpoint(model, registry=registry, tp_size=tp_size, kv_cache=kv_cache)
    if as_json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(render_plan(plan, verbose))
    return 0 if plan.ok else 1
