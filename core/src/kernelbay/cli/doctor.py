"""``kernelbay doctor``: device facts, and what each installed backend can do on this device."""

from __future__ import annotations

import json
from typing import Any

from kernelbay._table import render_table
from kernelbay.kinds import BackendKind
from kernelbay.plugins import Registry
from kernelbay.policy import Policy
from kernelbay.select import ask
from kernelbay.testing.samples import sample_requests

__all__ = ["doctor_report", "run_doctor"]


def doctor_report(registry: Registry) -> dict[str, Any]:
    """Device facts and, per backend, how many sample requests it accepts on this device."""
    device = registry.device()
    backends = []
    for kind in BackendKind:
        requests = sample_requests(kind)
        for candidate in registry.candidates(kind):
            verdicts = [ask(candidate.backend, r, device) for r in requests]
            accepted = sum(v.accepted for v in verdicts)
            first_reject = next((v.reason for v in verdicts if not v.accepted), "")
            backends.append({
                "kind": kind.value, "backend": candidate.name, "plugin": candidate.plugin,
                "priority": candidate.backend.priority, "accepted": accepted,
                "asked": len(requests), "example_rejection": first_reject,
            })
    return {
        "device": device.as_dict(),
        "device_text": device.describe(),
        "plugins": [{"name": r.name, "status": r.status.value, "reason": r.reason}
                    for r in registry.records],
        "backends": backends,
        "notes": list(registry.notes),
    }


def run_doctor(policy: Policy, *, as_json: bool) -> int:
    """Print the doctor report (or JSON)."""
    report = doctor_report(Registry.discover(policy))
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    dev = report["device"]
    print(f"device: {report['device_text']}")
    print(f"  isa: {', '.join(dev['isa']) or 'none detected'}")
    if dev["p2p"] is not None or dev["multicast"] is not None:
        print(f"  p2p: {dev['p2p']}, multicast: {dev['multicast']}")
    print("\nplugins:")
    print(render_table(["plugin", "status", "reason"],
                       [[p["name"], p["status"], p["reason"]] for p in report["plugins"]]))
    print("\nbackends on this device (sample requests accepted):")
    rows = [[b["kind"], b["backend"], b["plugin"], str(b["priority"]),
             f"{b['accepted']}/{b['asked']}",
             b["example_rejection"] if b["accepted"] == 0 else ""]
            for b in report["backends"]]
    print(render_table(["kind", "backend", "plugin", "prio", "accepts", "why not"], rows))
    for note in report["notes"]:
        print(f"note: {note}")
    return 0
