"""How a compiled step proves its speed, and what follows (engine/compile/proof.py says
what is recorded and when a package falls short): the race of the live step against the
eager step and the memory's read rate, a rebuild on a quiet machine when it falls short
(the faster of the two kept), and the eager step taking over from a package slower than
it. Mixed into step.CompiledStep, whose state these methods read and set; they run as
the compile worker's jobs (CompiledStep._when_free), never on an answer's thread."""
from __future__ import annotations

import os

from .. import hardware
from ..kernels import layer_kernel, row_kernel
from . import proof, quiet, race, worker

# A step is raced, and rebuilt if it falls short (engine/compile/proof.py), once the machine
# is quiet: the worker looks for a quiet moment this long, then queues the job again.
QUIET_WAIT_S = 2.0
RACE_TRIES = 30                  # then the step stays unproven for this start


def why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class Proving:
    def _prove(self) -> None:
        """Record the live step's race against the eager step and the memory's read rate
        beside its package, and rebuild the package when the machine is quiet if it falls
        short (engine/compile/proof.py). A step built now was raced by the build's child
        (engine/compile/race.py says why there); one loaded from the cache keeps the proof
        its build left; an in-process build is raced here. Only worker.Later escapes."""
        try:
            if not self.proof:
                self.proof = proof.read(self.package)
                if self._built:                      # built now: how that went
                    self.proof = {"built": self._built, "rebuilds": self.proof.get("rebuilds", 0)}
            if self._child_race is not None:
                got = self._child_race
            elif (self.source == "cache" and not proof.stale(self.proof, self._eager_kind())) \
                    or self.built_in == "child":
                got = None                           # (a child whose race never found quiet: none)
            else:
                got = self._quiet_race([None, self._fn])
        except worker.Later:
            self._race_tries += 1
            if self._race_tries < RACE_TRIES:
                raise
            self.notes.append("not proven: other programs kept the machine busy each time it was raced")
            self._proven.set()
            return
        except Exception as exc:
            self.notes.append(f"proving the step: {why(exc)}")
            self._proven.set()
            return
        if got is not None:
            self.proof["race"] = proof.race(got["ms"][0], got["ms"][1], self.target.weight_bytes(), got["bandwidth"],
                                            where=self.built_in or "process", eager=self._eager_kind())
        if got is not None or self._built:
            proof.write(self.package, self.proof)
        self.short = proof.short(self.proof)
        if self.short and self.build:
            self._when_free(self._rebuild)
        else:
            self._eager_if_slower(self.proof)
            self._proven.set()

    def _eager_wins_here(self) -> bool:
        """A package whose recorded race lost to the eager step, with no rebuild due."""
        if self.package is None or not self.package.exists():
            return False
        recorded = proof.read(self.package)
        why = proof.eager_wins(recorded) if not proof.stale(recorded, self._eager_kind()) else ""
        if why and not (proof.short(recorded) and self.build):
            self.proof = recorded
            self.notes.append(f"{why}: decoding eagerly")
            self._used()                     # still this model's package: kept, not swept as stale
            return True
        return False

    def _eager_kind(self) -> str:
        """What the eager step this package races runs its products on (proof.stale)."""
        impl = getattr(self.target, "impl", None)
        rows = getattr(impl, "rows", None)
        if rows is None or not rows.kernel:
            return "torch"
        if getattr(impl, "_stack", None) is not None:
            return f"row kernel {row_kernel.VERSION}, layer kernel {layer_kernel.VERSION}"
        return f"row kernel {row_kernel.VERSION}"

    def _eager_if_slower(self, record: dict) -> bool:
        """Stop using a package its race found slower than the eager step (proof.eager_wins):
        the eager step decodes from the next token, and the package's memory goes."""
        why = proof.eager_wins(record)
        if why and self.state == "ready":
            self.notes.append(f"{why}: decoding eagerly")
            self.state, self._fn, self.source = "off", None, ""
        return bool(why)

    def _quiet_race(self, fns: list) -> dict:
        """A race in this process (race.quietly's figures) on a quiet machine that nothing
        disturbed; worker.Later when it was not quiet, or was disturbed."""
        nbytes = race.read_bytes(self.target.weight_bytes())
        if not quiet.wait_quiet(QUIET_WAIT_S):
            raise worker.Later
        w = quiet.Window()
        ms = worker.off_thread(self._times, [*fns, nbytes], 1, 7, 3.0)
        if w.disturbed():
            raise worker.Later
        return {"ms": ms[:-1], "bandwidth": nbytes / (ms[-1] / 1e3)}

    def _rebuild(self) -> None:
        """Build the step again on a quiet machine (worker.Later: not quiet yet); the
        build's child races the new package against the live one, and the faster is kept
        (_settle)."""
        if not quiet.wait_quiet(QUIET_WAIT_S):
            raise worker.Later
        need = int(self.target.weight_bytes() * 1.1) + (256 << 20)   # the new package beside the live one
        free = hardware.available_memory(self.target.device)
        if free is not None and free < need:
            self.notes.append(f"not rebuilt ({self.short}): no memory for a second step beside the live one")
            self._proven.set()
            return
        try:
            with worker.building():
                self._next = self._build_aot(self.package.with_name(f"step.next{self._suffix}"), 1, self.mode,
                                             against=self.package)
        except Exception as exc:
            self.notes.append(f"rebuilding the step: {why(exc)}")
            self._proven.set()
            return
        self._next_built = self._built
        got = self._child_race
        if got is not None and len(got["ms"]) == 3:
            self._settle(got)
        else:                                       # built in this process, or no room in the child for both
            self._when_free(lambda: self._settle(self._quiet_race([None, self._next, self._fn])))

    def _settle(self, got: dict) -> None:
        """Keep the faster of the rebuilt package and the live one, from a race of
        [eager, new, old] (rebuilds are counted in the proof: a step that falls short after
        MAX_REBUILDS quiet rebuilds is what this machine does)."""
        eager, new_ms, old_ms = got["ms"]
        new_path = self.package.with_name(f"step.next{self._suffix}")
        keep_new = new_ms < old_ms
        if keep_new:
            os.replace(new_path, self.package)
            self._fn = self._next
            self.proof["built"] = self._next_built
        else:
            new_path.unlink(missing_ok=True)
            if "built" in self.proof:               # its choices beat ones made quiet
                self.proof["built"]["held"] = True
        self._next = None
        self.rebuilt = "kept new" if keep_new else "kept old"
        self.notes.append(f"rebuilt quiet ({self.short}): {new_ms:.2f} ms against {old_ms:.2f}, {self.rebuilt}")
        self.proof["rebuilds"] = self.proof.get("rebuilds", 0) + 1
        self.proof["race"] = proof.race(eager, min(new_ms, old_ms), self.target.weight_bytes(), got["bandwidth"],
                                        where=self.built_in or "process", eager=self._eager_kind())
        proof.write(self.package, self.proof)
        self.short = proof.short(self.proof)
        if not (self.short and self.build):
            self._eager_if_slower(self.proof)
        self._proven.set()
