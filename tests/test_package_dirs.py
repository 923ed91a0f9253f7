"""Package directories (engine/compile/package_dirs.py): keyed by what a package is valid for, and
stale ones swept."""
import os
import time

import torch

from engine.compile import package_dirs


def test_cache_key_separates_what_a_graph_is_valid_for():
    a = package_dirs.cache_key("m", torch.float32, "exact", torch.device("cpu"))
    assert a == package_dirs.cache_key("m", torch.float32, "exact", torch.device("cpu"))
    assert a != package_dirs.cache_key("m", torch.bfloat16, "exact", torch.device("cpu"))
    assert a != package_dirs.cache_key("other", torch.float32, "exact", torch.device("cpu"))
    assert a != package_dirs.cache_key("m", torch.float32, "exact", torch.device("cpu"), stamp="weights v2")


def test_stale_package_dirs_are_swept(tmp_path):
    pd = package_dirs
    day, now = 86400, time.time()
    me = pd.lineage("demo", torch.float32, "exact", torch.device("cpu"))
    other = pd.lineage("demo", torch.bfloat16, "exact", torch.device("cpu"))

    def folder(name, of, idle_days):
        f = tmp_path / name
        f.mkdir()
        (f / "step.pt2").write_bytes(b"x")
        if of is not None:
            pd.mark_used(f, of)
        for p in (f / "step.pt2", *([f / pd.META] if of is not None else []), f):
            os.utime(p, (now - idle_days * day, now - idle_days * day))
        return f

    own = folder("own", me, 0)
    superseded = folder("old-torch", me, pd.SUPERSEDED_DAYS + 1)
    recent_twin = folder("other-install", me, pd.SUPERSEDED_DAYS - 2)    # two installs, used in turn
    other_kind = folder("bf16", other, pd.SUPERSEDED_DAYS + 1)
    forgotten = folder("forgotten", other, pd.UNUSED_DAYS + 1)
    unmarked_old = folder("unmarked-old", None, pd.UNUSED_DAYS + 1)
    unmarked = folder("unmarked", None, pd.SUPERSEDED_DAYS + 1)

    removed = pd.sweep_stale(own, now=now)

    assert sorted(removed) == sorted([superseded, forgotten, unmarked_old])
    assert all(not f.exists() for f in removed)
    assert all(f.exists() for f in (own, recent_twin, other_kind, unmarked))
