"""`localchat setup` builds the compiled decode step of what it configured (issue 23), so
the first chat is already fast: on a machine it first checks is quiet (a build timed under
load keeps slow kernels for good: engine/compile/quiet.py), with a progress bar against an
estimate, and the step raced when it is done (its tok/s against eager and the bound).
`--no-build` skips it; the chat UI would build it in the background instead."""
from __future__ import annotations

import sys
import time
from typing import Callable

from . import config as config_mod
from .common import open_engine

QUIET_WAIT_S = 60.0


def estimate_seconds(layers: int, weight_bytes: int) -> float:
    """What a build takes on the development machine (two cores): mostly compiling, which
    grows with the layers (tiny 2-layer model ~20 s, demo 30 layers ~90-120 s), plus
    repacking the weights. Only for the bar: the real time is what it is."""
    return 15.0 + 3.0 * layers + weight_bytes / 300e6


def _bar(done: float, width: int = 28) -> str:
    full = int(width * min(done, 1.0))
    return "█" * full + "░" * (width - full)


def _clock(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def build(settings: config_mod.Settings, say: Callable[[str], None] = print, stream=None) -> bool:
    """Build (or find) the compiled step of `settings`' model and profile, and its verify
    passes when a drafter is on; True when a step is ready. Never raises for a build that
    fails: the chat decodes eagerly then, and says so."""
    from engine.compile import proof, quiet
    stream = stream or sys.stderr
    if settings.compile == "off":
        say("Not building the compiled step: compile is off in the settings")
        return False
    share = quiet.others_share(1.0)
    if share >= quiet.QUIET_BELOW:
        say(f"Other programs take {share:.0%} of this machine; waiting up to {QUIET_WAIT_S:.0f} s for a quiet "
            "moment before building (kernels timed under load stay slow)")
        if not quiet.wait_quiet(QUIET_WAIT_S):
            say("Still busy: building anyway; the step is rebuilt by itself at a quiet moment later if its timings "
                "were disturbed")
    eng = open_engine(settings, compile="on")
    step = eng.target.compiled
    if step is None or not step.step:
        say(f"No compiled step for this model: {eng.compile_note or 'it decodes eagerly'}")
        return False
    t = eng.target
    layers = getattr(t.impl, "layers", [])
    est = estimate_seconds(len(layers), t.weight_bytes())
    live = stream.isatty()
    if step.package is not None and step.package.exists():
        say(f"Loading the compiled decode step an earlier build left for {eng.name}")
    else:
        say(f"Building the compiled decode step of {eng.name} (once per machine; about {_clock(est)} here; "
            "--no-build skips it)")
    t0 = time.monotonic()
    while not step.wait(0.5 if live else 5.0):
        if step.state != "compiling":
            break
        if live:
            el = time.monotonic() - t0
            left = f"about {_clock(est - el)} left" if el < est else "a little longer than estimated"
            stream.write(f"\r  {_bar(el / est)} {_clock(el)} · {left}   ")
            stream.flush()
    if live:
        stream.write("\r" + " " * 72 + "\r")
    if step.state != "ready":
        say(f"The compiled step could not be built ({step.error or step.state}); the chat decodes eagerly")
        return False
    how = "found (built earlier)" if step.source == "cache" else f"built in {_clock(time.monotonic() - t0)}"
    if step.rows:
        say(f"Compiled step {how}; building the verify passes for the drafter ({', '.join(map(str, step.rows))} positions)")
        step.wait_passes()
    step.wait_proven(600)
    say(f"Compiled step {how}: {proof.describe(step.proof)}")
    return True
