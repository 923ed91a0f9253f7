"""The compiled decode step: a one-token step (and verify passes of a few fixed widths)
exported with torch.export and built by AOTInductor in a child process, loaded when
ready, used only where it is at least as exact as the eager forward, and proven fast
(raced, rebuilt when it was built under load). Imports run one way:
step -> worker, builder, package_dirs, proof -> race -> quiet, exported -> pages.

- step.py          CompiledStep: builds or loads the packages in the background and runs them
- worker.py        the compile thread: a queue, pausing for answers, torch work off the waiting thread
- builder.py       the child process that loads the target from its recipe and builds a package
- exported.py      export and AOTInductor packaging of a pass, and loading a package back
- pages.py         the memory pages of a loaded package's library, given back once its weights are copied
- package_dirs.py  where packages live, their key and stamp, and the sweep of stale ones
- quiet.py         whether the machine is quiet; autotuning timings taken again when disturbed
- race.py          racing passes (eager, compiled, a memory read) on scratch caches, and where to race
- proof.py         a step's record of its speed beside its package, and when it falls short
"""
