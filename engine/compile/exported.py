"""The decode step compiled ahead of time (AOTInductor) and kept on disk (issue 7).

`torch.compile` with freezing prepacks every GEMM weight for the CPU's kernels, and its
graph cache cannot store prepacked (mkldnn) constants, so a compiled step was rebuilt
from scratch on every start: about three minutes on a small CPU before decoding reached
its compiled speed. An AOTInductor package is the same inductor code (same freezing,
same autotuned kernels) built into a shared library, with the repacked weights as its
constants: it is compiled once per machine and model, and a later start loads it in
seconds (demo model: 2-5 s on two cores, against ~2 min to build).

What is exported is `_PassModule`: one token (or, for a verify pass, a fixed number of
positions) at a position `pos >= 2` over the conversation's own KV cache. The position travels as the length of a `marker` view
(export treats Python ints as constants, sizes can be symbolic), and the cache tensors
and the rotary tables are inputs whose length is symbolic, so one package serves every
position and a cache that has grown. The cache is written in place, as the eager step
writes it.

The step's package holds a copy of the weights (repacked, so they cannot be the
checkpoint's own): on disk it is about the size of the resident weights. Verify passes are
built without weights and given the forward's own tensors when loaded (a few MB each). On a
CPU a package is kept as its shared library alone (`suffix`): it loads with no unpacking,
through its C interface (engine/compile/library.py). Building and loading leave nothing
else behind: the build's working files, a GPU archive's unpacked files and the name a
library was loaded by are removed when done, and what a process that left with os._exit
could not remove is swept by the next.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
import shutil
import tempfile
import threading
import zipfile
from pathlib import Path

import torch

from . import library, pages

MIN_POS = 2                      # export specialises sizes 0 and 1; position 1 runs eagerly
# Verify passes are compiled for these numbers of positions; a pass of n positions runs in
# the smallest that holds it, padded (the padding rows write cache slots past the pass,
# which the next pass overwrites: nothing reads a slot before it is written).
VERIFY_ROWS = (2, 4, 8, 16)
# Inductor settings per build mode. Autotuned GEMM templates without epilogue fusion are
# the first choice: with it, max-autotune trips an inductor assertion on the bf16 graph
# ("AssertionError: buf17", torch 2.13), and in float32, same run, the fused step was
# slower (31.4 ms against 27.9; eager 49.7) and took longer to build (103 s against 87).
# Without it the bf16 demo step runs in 17 ms against 50 eager (the default mode: 1.07x).
MODES = {
    "max-autotune-unfused": {"max_autotune": True, "epilogue_fusion": False},
    "max-autotune": {"max_autotune": True},
    "default": {"max_autotune": False},
}
_MAX = 1 << 24
# Inductor runs a generated kernel on every thread once it has 512 elements of work; a
# decode step's elementwise kernels (norms, rotary, SiLU, residuals: a few thousand
# elements) then spend more on waking and joining the threads than on the work. Below this
# they run on one thread (the GEMMs keep every thread). Demo model, float32, two builds each,
# same process: 39.1 and 40.0 ms a step against 44.0 and 45.7 ms, with the bare matrix-vector
# products over the same weights at 36-38 ms.
SERIAL_BELOW = 1 << 16
# Part of the cache key (engine/compile/step.py): a change in how packages are built must not
# load a package built the old way.
FORMAT = "2"


def _tensors_of(obj) -> dict[str, torch.Tensor]:
    """The tensors a packed weight object (targets/qweights.py) holds, one level down
    included (an int4 weight's row reader)."""
    out = {}
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            out[k] = v
        elif hasattr(v, "__dict__") and not isinstance(v, type):
            out.update({f"{k}__{kk}": vv for kk, vv in _tensors_of(v).items()})
    return out


def _rebind(obj, name: str, get):
    """A copy of `obj` (a tensor or a packed weight) whose tensors are the module's
    attributes named after `name`: what export traces must be the module's own."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return get(name)
    c = copy.copy(obj)
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            setattr(c, k, get(f"{name}__{k}"))
        elif hasattr(v, "__dict__") and not isinstance(v, type) and _tensors_of(v):
            setattr(c, k, _rebind(v, f"{name}__{k}", get))
    return c


class _PassModule(torch.nn.Module):
    """A pass of the fast forward over `rows` positions as a module: every weight tensor
    registered (so export sees parameters, and freezing folds them), the cache and rotary
    tables passed in. One row is the decode step (last logits), more a verify pass (every
    row's logits)."""

    def __init__(self, impl, rows: int = 1):
        super().__init__()
        self.__dict__["impl"] = impl           # a plain attribute, not a submodule
        self.rows = rows
        self._slots: list[tuple[int, str, str]] = []   # (layer, field, name)
        for i, w in enumerate(impl.layers):
            for f in dataclasses.fields(w):
                if getattr(w, f.name) is not None:
                    self._register(f"l{i}_{f.name}", getattr(w, f.name))
                    self._slots.append((i, f.name, f"l{i}_{f.name}"))
        for a in ("embed", "norm", "head"):
            self._register(a, getattr(impl, a))

    def _register(self, name: str, v) -> None:
        items = {name: v} if isinstance(v, torch.Tensor) else {f"{name}__{k}": t for k, t in _tensors_of(v).items()}
        for n, t in items.items():
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(n, t)
            else:
                self.register_buffer(n, t)

    def forward(self, ids, marker, cos, sin, *kv):
        pos = marker.shape[0]
        torch._check(pos + self.rows <= kv[0].shape[2])
        torch._check(pos + self.rows <= cos.shape[0])
        get = lambda n: getattr(self, n)   # noqa: E731
        impl = copy.copy(self.impl)
        impl.layers = [dataclasses.replace(w) for w in impl.layers]
        for i, f, name in self._slots:
            setattr(impl.layers[i], f, _rebind(getattr(self.impl.layers[i], f), name, get))
        impl.embed, impl.norm, impl.head = (_rebind(getattr(self.impl, a), a, get) for a in ("embed", "norm", "head"))
        impl._cos, impl._sin = cos, sin
        impl._scalar_cache = {}                # constants made while tracing stay in the trace
        # One-row products stay one row in the compiled step: its kernels are inductor's own,
        # so its bits differ from eager's anyway (the build's check measures how far), and a
        # padded two-row product makes it pick a GEMM over its matrix-vector kernel (measured:
        # the bf16 demo step at 0.96x eager padded, against 2.4x unpadded; models/rows.py).
        impl._pad = False
        impl._kernel = False                   # the row kernel is a C call: nothing to trace
        impl.cache = copy.copy(impl.cache)
        n = len(kv) // 2
        impl.cache.k, impl.cache.v = list(kv[:n]), list(kv[n:])
        return impl(ids, pos, self.rows > 1)


def as_parameters(impl) -> None:
    """Freezing folds parameters into the graph (plain tensors reached through Python
    objects would stay graph inputs, and their GEMMs unpacked). The data is shared."""
    def p(t):
        if t is None or isinstance(t, torch.nn.Parameter):
            return t
        if not isinstance(t, torch.Tensor):
            # A packed int8/int4 weight (targets/qweights.py): its tensors become
            # parameters, so its kernel's weight is a constant of the graph too.
            for name, v in vars(t).items():
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    setattr(t, name, torch.nn.Parameter(v, requires_grad=False))
            return t
        return torch.nn.Parameter(t, requires_grad=False)
    for w in impl.layers:
        for f in dataclasses.fields(w):
            setattr(w, f.name, p(getattr(w, f.name)))
    impl.embed, impl.norm, impl.head = p(impl.embed), p(impl.norm), p(impl.head)


def constants(impl, rows: int = 1) -> dict[str, torch.Tensor]:
    """The weights of `impl` under the names an exported pass knows them by: what a
    package built without its weights (a verify pass) is given to run on."""
    m = _PassModule(impl, rows)
    return {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers(remove_duplicate=False))}


def _marker(pos: int, device) -> torch.Tensor:
    # A zero-stride view: its size carries the position, it reads and allocates nothing.
    return torch.empty(1, device=device).expand(pos)


def build(impl, kv: list[torch.Tensor], path: Path, mode: str, private_cache: bool = True, rows: int = 1) -> None:
    """Export a pass of `rows` positions over the scratch cache `kv` and compile it into
    the package at `path` (written under a temporary name first: a crash leaves no half
    package).

    The decode step (rows=1) is frozen: its weights are repacked into the package. A
    verify pass is built without its weights and runs on the eager forward's own
    (`constants`): a copy per bucket would cost the model's size in memory four times
    over, and at 2-16 rows prepacking gains less than at one."""
    from torch.export import Dim, export

    _sweep(path.parent)
    cap, rope = Dim("capacity", min=MIN_POS + rows, max=_MAX), Dim("rope", min=MIN_POS + rows, max=_MAX)
    pos = Dim("pos", min=MIN_POS, max=_MAX - rows)
    ids = torch.zeros(rows, dtype=torch.long, device=kv[0].device)
    args = (ids, torch.empty(MIN_POS, device=ids.device), impl._cos, impl._sin, *kv)
    shapes = {"ids": None, "marker": {0: pos}, "cos": {0: rope}, "sin": {0: rope}, "kv": tuple({2: cap} for _ in kv)}
    # "<name>-<pid>": the sweep reads the pid after the first dash ("verify-4" loses its own).
    tmp = path.with_name(f".{path.stem.replace('-', '')}-{os.getpid()}.partial.pt2")
    # Inductor writes the build's code and a copy of the weights into its cache dir; kept,
    # that would be another copy of the model per build (gigabytes in /tmp): unless the
    # user chose a TORCHINDUCTOR_CACHE_DIR, this build gets a directory of its own,
    # removed when it is done.
    work = path.parent / f".build-{os.getpid()}"
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if private_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work)
    try:
        ep = export(_PassModule(impl, rows), args, dynamic_shapes=shapes, strict=False)
        weights = {"freezing": True, "cpp.weight_prepack": True} if rows == 1 else \
            {"freezing": False, "aot_inductor.package_constants_in_so": False}
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs={
            **weights, "cpp.min_chunk_size": SERIAL_BELOW, **MODES[mode]})
        if path.suffix == ".so":
            _library_out(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        if private_cache:
            _restore("TORCHINDUCTOR_CACHE_DIR", old)
            shutil.rmtree(work, ignore_errors=True)
        tmp.unlink(missing_ok=True)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _sweep(folder: Path) -> None:
    """Remove what builds of processes that are gone left behind (a process that leaves
    with os._exit mid-build cannot clean up): their half packages and build dirs."""
    _remove_if_dead([*folder.glob(".build-*"), *folder.glob(".*-*.partial.pt2"), *folder.glob(".*-*.partial.so"),
                     *folder.glob(".load-*")])


def _sweep_unpacked() -> None:
    """Unpacked packages of processes that left mid-load (os._exit skips every cleanup)."""
    _remove_if_dead(Path(tempfile.gettempdir()).glob("localchat-step-*"))


def _remove_if_dead(paths) -> None:
    # Every leftover is named "<what>-<pid>...": the pid says whether its owner still runs.
    for p in paths:
        m = re.search(r"-(\d+)", p.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def suffix(device: torch.device) -> str:
    """What a package is kept as: on a CPU its shared library alone (".so": it holds the
    code, the call spec and the weights, and loads with no unpacking), elsewhere the whole
    AOTInductor archive (".pt2": a GPU's kernels are files beside the library)."""
    return ".so" if torch.device(device).type == "cpu" else ".pt2"


def _library_out(archive: Path, path: Path) -> None:
    """Move the shared library out of the archive `archive` to `path` (whole or not at all)
    and remove the archive. Loading the archive unpacked every file of it at every start
    (the weights included) and went through the archive loader: 1.3 s for the demo
    model's float32 step, against 0.25 s to load its library (and the loader needs
    torch._inductor, whose import is 0.85 s more)."""
    with zipfile.ZipFile(archive) as z:
        libs = [i for i in z.infolist() if i.filename.endswith(".so")]
        if len(libs) != 1:
            raise ValueError(f"{archive.name}: {len(libs)} libraries in the package, expected one")
        tmp = path.with_name(f".{path.stem.replace('-', '')}-{os.getpid()}.partial.so")
        try:
            with z.open(libs[0]) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    archive.unlink(missing_ok=True)


def migrate(path: Path) -> None:
    """A package an earlier version kept as an archive, where its library alone is wanted
    now: take the library out (once; the weights and choices it was built with are kept)."""
    old = path.with_suffix(".pt2")
    if path.suffix == ".so" and not path.exists() and old.exists():
        try:
            _library_out(old, path)
        except zipfile.BadZipFile as exc:
            raise ValueError(f"{old.name} is not a package ({exc})") from None


_loads = itertools.count()
_preloads: dict[Path, tuple[threading.Thread, dict]] = {}


def preload(path: Path) -> None:
    """Start loading the step package at `path` (if there is one) on a thread of its own,
    for a step that will want it later (take_preloaded): a one-shot answer's, loaded while
    the model's weights load, so that its load costs the answer nothing. The library's
    loader copies the weights out off the interpreter lock (engine/compile/library.py)
    and runs no parallel torch work, so the thread holds no OpenMP team."""
    if path.suffix != ".so" or not path.is_file() or path in _preloads:
        return
    out: dict = {}

    def run():
        try:
            out["package"] = Package(path, 1)
        except Exception as exc:             # the late load tries again and says why
            out["error"] = exc
    t = threading.Thread(target=run, name="localchat-step-preload", daemon=True)
    _preloads[path] = (t, out)
    t.start()


def take_preloaded(path: Path) -> "Package | None":
    """The package preload() loaded from `path`, once it is loaded; None if none was."""
    got = _preloads.pop(path, None)
    if got is None:
        return None
    got[0].join()
    return got[1].get("package")


def drop_preloaded(path: Path) -> None:
    """A preload nobody will take (the step is not compiled after all): its memory goes."""
    package = take_preloaded(path)
    if package is not None:
        package.release_files()


class Package:
    """A loaded package, run as a pass over `impl`'s cache: `package(impl, ids, pos)` ->
    logits (the last row's for the step, every row's for a verify pass of `rows`, padding
    rows included). A verify pass runs on the weights of `weights_of` (a forward)."""

    def __init__(self, path: Path, rows: int = 1, weights_of=None):
        self.path = path
        self.rows = rows
        self.unpacked = None
        self._loaded_as = None
        if path.suffix == ".so":
            self._runner = self._library(path, rows)
            self._run = self._runner if rows == 1 else lambda *args: self._runner.run(list(args))[0]
        else:
            self._runner = self._archive(path)
            self._run = self._runner
        try:
            if rows > 1:
                # The loader keeps pointers to these tensors (user-managed): the forward
                # holds them for as long as the package is used, and so does this dict.
                self._weights = constants(weights_of, rows)
                self._load_constants()
        except BaseException:
            self.release_files()
            raise

    def _library(self, path: Path, rows: int):
        """The library loaded under a name of its own: the dynamic loader hands back a
        library already loaded under the same name, so a package rebuilt in place (or a
        second rebuild at `step.next.so`) would run the old code. A hard link costs
        nothing; it is removed once loaded (the mapping keeps the file)."""
        name = path.with_name(f".load-{os.getpid()}-{next(_loads)}.so")
        try:
            os.link(path, name)
        except OSError:
            name = path          # a read-only cache dir (nothing is rebuilt there) or no hard links
        self._loaded_as = name
        try:
            if rows == 1:
                return library.Library(name)        # (engine/compile/library.py says why)
            return torch._C._aoti.AOTIModelContainerRunnerCpu(str(name), 1)
        finally:
            if name != path:
                name.unlink(missing_ok=True)

    def _archive(self, path: Path):
        # The loader unpacks the package (the weights included) into a temporary directory
        # and removes it only when the loaded model is destroyed, which a process that
        # leaves with os._exit never does: unpack into a directory of our own instead, and
        # remove it once the step has run (release_files), when nothing needs the files.
        _sweep_unpacked()
        self.unpacked = Path(tempfile.mkdtemp(prefix=f"localchat-step-{os.getpid()}-"))
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(self.unpacked)
        try:
            return torch._inductor.aoti_load_package(str(path))
        except BaseException:
            self.release_files()
            raise
        finally:
            _restore("TMPDIR", old)

    def _load_constants(self) -> None:
        if self.unpacked is not None:
            wanted = set(self._runner.get_constant_fqns())
            self._weights = {k: v for k, v in self._weights.items() if k in wanted}
            self._runner.load_constants(self._weights, check_full_update=True, user_managed=True)
            return
        names = {fqn: name for name, fqn in self._runner.get_constant_names_to_original_fqns().items()}
        self._weights = {k: v for k, v in self._weights.items() if k in names}
        self._runner.update_constant_buffer({names[k]: v for k, v in self._weights.items()}, False, True, True)

    def release_files(self) -> None:
        """Give back the pages of the library's copy of the weights: loading copied them
        out, and they are never read again. A kept library stays in the page cache (the
        system's to reclaim; the next start loads from it); an unpacked archive goes."""
        if self._loaded_as is not None:
            pages.drop_file_pages(self._loaded_as.parent, only=self._loaded_as, keep_cached=True)
        if self.unpacked is not None:
            # (a mapped file, deleted, would keep its pages to the end)
            pages.drop_file_pages(self.unpacked)
            shutil.rmtree(self.unpacked, ignore_errors=True)

    def __call__(self, impl, ids: torch.Tensor, pos: int) -> torch.Tensor:
        impl._rope(pos, self.rows, impl.norm)       # the table must reach the pass (it grows, rarely)
        if ids.numel() < self.rows:
            ids = torch.nn.functional.pad(ids, (0, self.rows - ids.numel()))
        return self._run(ids, _marker(pos, ids.device), impl._cos, impl._sin, *impl.cache.k, *impl.cache.v)
