"""What a built step has shown of its speed, kept beside its package (issue 23).

A package is only as fast as the kernel choices its build made, and a build that timed its
candidates under load keeps slow ones for good (engine/compile/quiet.py). So each step
package has a record, `step.proof.json` beside `step.pt2`:

- "built": how its build went (mode, when, the quiet.Record: timings retimed or never
  quiet, the share of the machine others took meanwhile);
- "race": the step raced against the eager step on the same weights, interleaved (so the
  ratio holds whatever the machine's bandwidth does that minute), and the bound that the
  measured read bandwidth puts on a step that reads every weight once;
- "rebuilds": how many quiet rebuilds it has had.

A race's verdict holds only against the eager step it was run against: the race records
that step's kind ("eager": torch's kernels, or the row kernel of a version), and a race
against another (this version's eager step is faster) is run again before it decides
anything (`stale`).

`short()` says why a package falls short (and is rebuilt when the machine is quiet), or
"" when it does not. `localchat doctor` prints `describe()` for every package.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

# Below this share of the bandwidth bound a step is short. A quiet build of the demo model
# reaches 40-60% of it (float32: 19.5 ms a step against a bound of 7.8 ms, the read rate
# measured in the same race at 69 GB/s); the packages built under load read their weights
# at 10-15 GB/s, under a quarter of it. Small models sit in the caches, where the bound
# says nothing, and their steps take a fraction of a millisecond either way (the tests'
# tiny model: 0.4 ms compiled and eager): the race's verdicts apply from BOUND_FROM bytes
# of weights.
BOUND_FLOOR = 0.30
BOUND_FROM = 256 << 20
# Rebuilt this often, a step built under load that still falls short is kept (the machine
# is never quiet for long); one built quiet that falls short of its race is rebuilt once.
# (The bf16 demo step here: 13.8 ms against 17.2 eager, 26% of the bound, built quiet and
# rebuilt quiet alike: what inductor's bf16 kernels do on this CPU.)
MAX_REBUILDS = 2


def path_of(package: Path) -> Path:
    return Path(package).with_suffix(".proof.json")


def read(package: Path) -> dict:
    try:
        out = json.loads(path_of(package).read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def write(package: Path, proof: dict) -> None:
    """Written whole under a temporary name: a reader never sees half a record."""
    path = path_of(package)
    tmp = path.with_name(f".{path.name}-{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(proof, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)        # a read-only cache dir: proven again next start


def built(record: dict, mode: str) -> dict:
    return {**record, "mode": mode, "at": round(time.time())}


def race(eager_ms: float, step_ms: float, weight_bytes: int, bandwidth: float | None, where: str = "child",
         eager: str = "") -> dict:
    """`where` the race ran: "child" (the build's process, the step's thread the only OpenMP
    team) or "process" (the chat's: on a CPU a second team slows the step more than eager);
    `eager`: the kind of eager step it raced (stale())."""
    out = {"at": round(time.time()), "eager_ms": round(eager_ms, 3), "step_ms": round(step_ms, 3),
           "weight_bytes": int(weight_bytes), "where": where, "eager": eager}
    if bandwidth:
        out["bandwidth"] = round(bandwidth)
        out["bound_ms"] = round(weight_bytes / bandwidth * 1e3, 3)
    return out


def stale(proof: dict, eager: str) -> bool:
    """Whether the recorded race ran against another eager step than `eager` (or none is
    recorded): its verdict says nothing about this one."""
    return (proof.get("race") or {}).get("eager") != eager


def of_bound(proof: dict) -> float | None:
    r = proof.get("race") or {}
    if not r.get("bound_ms") or not r.get("step_ms") or r.get("weight_bytes", 0) < BOUND_FROM:
        return None
    return r["bound_ms"] / r["step_ms"]


def short(proof: dict) -> str:
    """Why the package falls short and should be rebuilt quiet, or "" (it does not, or a
    quiet rebuild already showed that this is what the machine does)."""
    b, r = proof.get("built") or {}, proof.get("race") or {}
    if proof.get("rebuilds", 0) >= MAX_REBUILDS:
        return ""
    if b and not b.get("quiet", True) and not b.get("held"):     # held: it beat a quiet rebuild
        if b.get("unsteady"):
            return f"{b['unsteady']} of its {b.get('timed', 0)} autotuning timings were never taken on a quiet machine"
        return f"it was built while other programs took {b.get('others', 0):.0%} of the machine"
    if proof.get("rebuilds", 0) >= 1:            # built quiet, rebuilt quiet: this is what the machine does
        return ""
    if r.get("weight_bytes", 0) < BOUND_FROM:
        return ""
    if r.get("step_ms") and r.get("eager_ms") and r["step_ms"] >= r["eager_ms"]:
        return f"it is no faster than the eager step ({r['step_ms']:.1f} ms against {r['eager_ms']:.1f})"
    frac = of_bound(proof)
    if frac is not None and frac < BOUND_FLOOR:
        return f"it reaches {frac:.0%} of what the memory's read rate allows"
    return ""


# A package is used only if its race beat the eager step by this much: it holds a second
# copy of the weights, and a race closer than this is a tie that the read rate's drift
# decides. Demo model in float32, both at the memory's bound (the 2-core Intel Xeon VM with AMX): the step
# raced 25.8 ms against 25.9 eager in its build, then decoded at 34.2 tok/s against the
# eager step's 37.2 in the benchmark that followed (benchmarks/peers.py, 0.92x).
WIN_MARGIN = 0.05


def eager_wins(proof: dict) -> str:
    """Why the eager step should decode instead of this package ("" when the package is
    faster, or too small for a race to tell). Once no rebuild is due (short() is ""), a
    package slower than eager is not used: measured on Qwen3-1.7B's shape in bf16, the
    quiet-built step took 134 ms a token against 108 eager (int4: 45 against 35)."""
    r = proof.get("race") or {}
    if r.get("weight_bytes", 0) < BOUND_FROM or not (r.get("step_ms") and r.get("eager_ms")):
        return ""
    if r["step_ms"] > r["eager_ms"] * (1 - WIN_MARGIN):
        return f"the compiled step took {r['step_ms']:.1f} ms a token against {r['eager_ms']:.1f} eager"
    return ""


def describe(proof: dict) -> str:
    """One line for `localchat doctor`: measured tok/s, eager's, the bound, how it was built."""
    b, r = proof.get("built") or {}, proof.get("race") or {}
    parts = []
    if r.get("step_ms"):
        parts.append(f"{1e3 / r['step_ms']:.1f} tok/s (eager {1e3 / r['eager_ms']:.1f}, "
                     f"{r['eager_ms'] / r['step_ms']:.2f}x)")
        if r.get("bound_ms") and r.get("weight_bytes", 0) >= BOUND_FROM:
            parts.append(f"bound {1e3 / r['bound_ms']:.0f} tok/s at {r['bandwidth'] / 1e9:.0f} GB/s "
                         f"({r['bound_ms'] / r['step_ms']:.0%})")
        if eager_wins(proof):
            parts.append("not used: the eager step is faster")
    else:
        parts.append("not raced yet")
    if b:
        parts.append(f"built {b.get('mode', '?')}, " + ("quiet" if b.get("quiet", True) else
                     "under load, and faster than a quiet rebuild" if b.get("held") else
                     f"under load ({b.get('others', 0):.0%} of the machine taken by others, "
                     f"{b.get('unsteady', 0)} timings unsteady)"))
    if proof.get("rebuilds"):
        parts.append(f"rebuilt {proof['rebuilds']}x")
    why = short(proof)
    if why:
        parts.append(f"to be rebuilt when the machine is quiet: {why}")
    return "; ".join(parts)
