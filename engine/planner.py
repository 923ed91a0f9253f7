"""The memory model and the choice of profile.

For a model, a device budget and each profile, every term of
    M_rt + M_W + M_KV + M_act + M_drafter + margin <= budget
is computed from the model's config (and, for a local checkpoint, the exact tensor sizes
in its safetensors headers: no weights are read). M_sys, what the rest of the machine
uses, is already outside the budget: detection reports *free* memory.

A Plan keeps every term of every profile, which fit, which was chosen and why, and the
predicted decode bound in tokens/s (bytes read per token / bandwidth). It prints as a
table (`localchat doctor`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .errors import BadRequest
from .hardware import Hardware
from .profiles import Profile
from .shape import ModelShape

# Memory the runtime takes on the device before any weight (documented constants,
# measured: the CUDA context plus the caching allocator's slack; on a CPU the Python
# process with torch and transformers imported, ~0.45 GB RSS).
RUNTIME_BYTES = {"cuda": 600 * 2**20, "rocm": 700 * 2**20, "mps": 300 * 2**20, "cpu": 450 * 2**20}
# Bandwidths when `localchat doctor --measure` has not measured them (bytes/s).
DEFAULT_BANDWIDTH = {"cuda": 900e9, "rocm": 900e9, "mps": 100e9, "cpu": 20e9,
                     "host_to_device": 24e9, "disk": 1.5e9}
PREFETCH_DEPTH = 2           # streamed layers in flight: the buffers the streamer owns
PREFILL_CHUNK = 512         # tokens a prefill pass runs at most (engine/decode.py)
STREAMED_PREFILL_CHUNK = 8 * PREFILL_CHUNK    # a streamed pass moves every weight once: fewer, wider


@dataclass
class PlanRow:
    profile: str
    summary: str
    weights: int
    kv: int
    drafter: int
    activations: int
    runtime: int
    margin: int
    total: int
    budget: int
    fits: bool
    context: int                 # tokens of KV cache planned for
    max_context: int             # the longest context that fits with this profile
    resident_layers: int
    host_layers: int
    disk_layers: int
    streamed_bytes_per_pass: int
    tps_bound: float             # predicted decode tokens/s at one token per pass
    note: str = ""
    state: int = 0               # a hybrid's recurrent states (live + the turn checkpoint): fixed, not per token
    read_per_token: int = 0      # the bytes a one-token pass reads (a mixture: only its routed experts)
    mapped_experts: int = 0      # a mixture's quantized experts left memory-mapped on disk (not in the budget)
    disk_per_token: int = 0      # of read_per_token, what comes from disk when they are routed to
    prefill_chunk: int = PREFILL_CHUNK   # tokens a prefill pass runs at most (counted in activations)
    routing_tokens: int = 0      # held tokens the experts' use was measured on (0: uniform routing assumed)
    kept_experts: int = 0        # with mapped_experts: the expert bytes kept in memory
    placement: str = "resident"  # the profile's: resident | streamed (a user's profile may have any name)

    @property
    def short_by(self) -> int:
        return max(0, self.total - self.budget)


def context_limit(row: PlanRow, own: int, context: int | None) -> tuple[int, str]:
    """How long a conversation may grow under `row`, and why: --context where given, else
    the model's own (`own`, its config), bounded by what the plan fits beside the weights (the
    KV cache grows into it as the conversation does). A streamed profile keeps the context it
    was planned for: the rest of its budget holds weights."""
    if context:
        return min(own, context), f"--context {context}" + (f" (the model's own is {own:,})" if context > own else "")
    if row.placement == "streamed":
        return min(own, row.context), f"planned for streaming (the model's own is {own:,}; --context plans for more)"
    limit = min(own, max(row.context, row.max_context))
    return limit, "the model's own" if limit == own else f"what fits in memory (the model's own is {own:,})"


@dataclass
class Plan:
    model: str
    device: str
    budget: int
    rows: list[PlanRow]
    chosen: str | None
    reason: str
    bandwidth: dict = field(default_factory=dict)
    # Profiles the engine has no target for on this model (shown for what they would need)
    not_runnable: list = field(default_factory=list)

    def row(self, name: str) -> PlanRow:
        return next(r for r in self.rows if r.profile == name)

    def as_dict(self) -> dict:
        return asdict(self)


def activation_bytes(shape: ModelShape, positions: int, context: int, chunk: int = PREFILL_CHUNK) -> int:
    """Peak transient memory of the widest pass: a verify pass over `positions` tokens or a
    prefill chunk of `chunk`, whichever is wider: hidden states and the widest
    intermediates, attention scores if the math path materialises them; and the float32
    logits of every position of a verify pass (a prefill's are the last token's only)."""
    wide = max(positions, min(chunk, context))         # no pass is wider than the context
    per_pos = (4 * shape.hidden + 2 * shape.intermediate + (shape.heads + 2 * shape.kv_heads) * shape.head_dim)
    hidden = wide * per_pos * max(shape.dtype_bytes, 4)
    scores = wide * shape.heads * context * 4
    logits = positions * shape.vocab * 4
    return hidden + scores + logits


def make_plan(shape: ModelShape, hw: Hardware, profiles: list[Profile], context: int = 8192,
              drafter: ModelShape | None = None, force: str | None = None,
              bandwidth: dict | None = None, runnable: tuple[str, ...] | None = None,
              drafter_weights: str = "exact", quant_act_bytes: int | None = None, routing=None) -> Plan:
    """Every term of every profile; the chosen one is the first (by rank) that fits and,
    if `runnable` is given, that the engine has a target for. `quant_act_bytes`: the element
    size a quantized target computes in (its unquantized embeddings, norms and KV
    cache) when it differs from the checkpoint's. `routing`: a mixture's measured expert
    use (targets/routing.py), which decides what a token reads from experts left on disk;
    None: uniform routing."""
    bw = dict(DEFAULT_BANDWIDTH)
    bw.update(bandwidth or {})
    kind = "cpu" if hw.device == "cpu" else next((a.kind for a in hw.accelerators if a.device == hw.device), "cuda")
    runtime = RUNTIME_BYTES.get(kind, RUNTIME_BYTES["cuda"])
    if kind == "cpu" and "vram" in hw.overrides:
        # On a CPU, --vram is the memory the engine may hold (weights, KV, buffers); the
        # Python runtime lives outside it.
        runtime = 0
    # resident-gguf holds a .gguf model's own blocks: no row for a model that has none
    profiles = sorted((p for p in profiles if p.weights != "gguf" or shape.gguf_linear_bytes),
                      key=lambda p: (p.rank, p.name))    # the choice below takes the first that fits
    rows = [_chunked_row(shape, hw, p, context, drafter, runtime, kind, bw, drafter_weights, quant_act_bytes,
                         routing) for p in profiles]
    skip = [] if runnable is None else [p.name for p in profiles if p.name not in runnable]
    if force:
        row = next((r for r in rows if r.profile == force), None)
        if row is None:
            raise BadRequest(f"--profile {force}: no such profile (have: {', '.join(r.profile for r in rows)})")
        if not row.fits:
            need, budget = gb_apart(row.total, row.budget)
            raise BadRequest(f"--profile {force} needs {need} but the budget is {budget}: "
                             f"short by {gb(row.short_by)}; lower --context, raise --vram, or pick another profile")
        return Plan(shape.name, hw.device, hw.budget_bytes, rows, force, f"{force} was asked for with --profile.", bw,
                    skip)
    fitting = [r for r, p in zip(rows, profiles) if r.fits and (runnable is None or p.name in runnable)]
    if not fitting:
        smallest = min((r for r in rows if runnable is None or r.profile in runnable), key=lambda r: r.short_by,
                       default=min(rows, key=lambda r: r.short_by))
        return Plan(shape.name, hw.device, hw.budget_bytes, rows, None,
                    f"Nothing fits in {gb(hw.budget_bytes)}: the smallest need is {smallest.profile} at "
                    f"{gb(smallest.total)} (short by {gb(smallest.short_by)}).", bw, skip)
    best = fitting[0]          # by rank: exact > int8 > int4 > streamed
    better = [r for r in rows[:rows.index(best)]]
    if not better:
        what = "the file's own blocks" if best.profile == "resident-gguf" else "the original weights"
        reason = f"{best.profile}: {what} fit on the device with room for {best.context} tokens of context."
    else:
        reason = (f"{best.profile}: {better[0].profile} would need {gb(better[0].total)} of the "
                  f"{gb(hw.budget_bytes)} budget; this is the best profile that fits.")
    return Plan(shape.name, hw.device, hw.budget_bytes, rows, best.profile, reason, bw, skip)


def _chunked_row(shape, hw, p: Profile, context: int, *args) -> PlanRow:
    """The profile's row with the widest prefill chunk that fits: the nominal one, else
    halved down to one verify pass (a small budget prefills in smaller chunks rather than
    refuse the profile)."""
    chunk = min(STREAMED_PREFILL_CHUNK if p.placement == "streamed" else PREFILL_CHUNK, context)
    while True:
        row = _row(shape, hw, p, context, *args, chunk=chunk)
        if row.fits or chunk <= p.max_draft + 1:
            return row
        chunk = max(p.max_draft + 1, chunk // 2)


def _row(shape: ModelShape, hw: Hardware, p: Profile, context: int, drafter: ModelShape | None,
         runtime: int, kind: str, bw: dict, drafter_weights: str = "exact",
         quant_act_bytes: int | None = None, routing=None, chunk: int = PREFILL_CHUNK) -> PlanRow:
    budget = hw.budget_bytes
    if p.weights in ("int8", "int4") and quant_act_bytes:
        shape = replace(shape, dtype_bytes=quant_act_bytes)
    if p.weights == "gguf":
        shape = replace(shape, dtype_bytes=4)          # a GGUF target computes and caches in float32
    kv_tok = shape.kv_bytes_per_token()
    draft_bytes = 0
    if drafter is not None and p.drafter in ("auto", "model", "mtp"):
        # "profile": the checkpoint's own MTP layer, held in the profile's format
        mine = drafter_weights == "profile"
        if mine and p.weights in ("int8", "int4") and quant_act_bytes:
            drafter = replace(drafter, dtype_bytes=quant_act_bytes)      # held as the target computes
        draft_bytes = (drafter.weight_bytes(p.weights if mine else drafter_weights, p.group_size if mine else 32)
                       + drafter.kv_bytes_per_token() * context)
    act = activation_bytes(shape, p.max_draft + 1, context, chunk)
    # A fixed margin suits a GPU; a small --vram budget (a CPU "device" in tests, a small
    # card) keeps a tenth of itself free instead of more than it has.
    margin = min(p.margin_mib * 2**20, budget // 10)
    # A hybrid's recurrent states (live + the one turn checkpoint) count with the KV cache:
    # per conversation, not per token.
    # Speculation on a hybrid adds the replay buffer of max_draft + 1 positions.
    state = 2 * shape.state_bytes + shape.replay_bytes(p.max_draft)
    kv = kv_tok * context
    fixed = runtime + kv + state + act + draft_bytes + margin
    weights = shape.weight_bytes(p.weights, p.group_size, p.head_format)
    resident, host, disk, streamed = shape.layers, 0, 0, 0
    note = ""
    # a mixture streamed on a CPU reads its routed experts where they lie in the files
    # (targets/streamed_modules.expert_views): they are neither units nor in the budget
    files_experts = (shape.expert_params * shape.dtype_bytes if p.placement == "streamed" and kind == "cpu"
                     and shape.file_dtype_bytes in (0, shape.dtype_bytes) else 0)
    if p.placement == "streamed":
        units, fixed_w, embed = streamed_units(shape, bool(files_experts))
        host_room = max(0, hw.host_available_bytes - margin) if kind != "cpu" else 0
        # what the loader stages (streamed.placement): a unit's file bytes wherever they are
        # not read straight into the slot (another dtype, or a device copy)
        file_bytes = shape.file_dtype_bytes or shape.dtype_bytes
        staging = 0 if kind == "cpu" and file_bytes == shape.dtype_bytes else \
            max(units) * file_bytes // shape.dtype_bytes
        place = place_streamed(units, max(units), fixed_w, embed, budget - fixed, host_room, staging_bytes=staging)
        resident, host = place.resident_layers(shape.layers), place.host_layers(shape.layers)
        disk = shape.layers - resident - host
        streamed = place.streamed_bytes
        weights = place.device_bytes if place.fits else place.min_budget
        if not place.fits:
            note = f"needs at least {gb(fixed + place.min_budget)}"
    device_bw = bw.get(kind, bw["cpu"])
    mapped = from_disk = kept = 0
    if fixed + weights > budget and p.placement == "resident" and p.weights in ("int8", "int4") and kind == "cpu" \
            and shape.expert_params:
        mapped, from_disk, kept = _mapped_experts(shape, p, budget - fixed - weights, device_bw, bw["disk"], routing)
        weights -= mapped
        if mapped:
            note = f"{gb(mapped)} of its experts stay memory-mapped on disk, read when routed to"
    total = fixed + weights
    fits = total <= budget
    spare = budget - (total - kv)
    max_context = max(0, spare // kv_tok) if kv_tok else 0
    if p.placement == "resident":
        read = shape.read_bytes(p.weights, p.group_size, head=p.head_format)
        seconds = (read - from_disk) / device_bw + from_disk / bw["disk"]
    else:
        # a streamed layer is moved whole (on a device: every expert of it)
        read = place.resident_bytes + place.streamed_bytes
        seconds = (read / device_bw + place.host_streamed_bytes / bw["host_to_device"]
                   + place.disk_streamed_bytes / bw["disk"])
        if files_experts:
            # the routed experts, from the page cache as far as the memory the plan leaves
            # free holds them, else from disk
            routed = int(files_experts * shape.expert_fraction(1))
            cached = min(files_experts, max(0, budget - total))
            from_disk = int(routed * (1 - cached / files_experts))
            read += routed
            seconds += (routed - from_disk) / device_bw + from_disk / bw["disk"]
            mapped, kept = files_experts, cached
    return PlanRow(p.name, p.summary, weights, kv, draft_bytes, act, runtime, margin, total, budget, fits,
                   context, int(max_context), resident, host, disk, streamed,
                   1.0 / seconds if seconds > 0 else 0.0, note, state, read, mapped, from_disk,
                   max(chunk, p.max_draft + 1), routing.tokens if mapped and routing else 0, kept, p.placement)


# A mixture's experts are left on disk only while what a token reads from there keeps at
# least this share of the speed it would have with every expert in memory.
MAPPED_MIN_SPEED = 0.5


def _mapped_experts(shape: ModelShape, p: Profile, short: int, device_bw: float, disk_bw: float,
                    routing=None) -> tuple[int, int, int]:
    """(expert bytes left memory-mapped on disk, bytes a token reads from there, expert bytes
    kept in memory) for a quantized
    mixture on a CPU that is `short` (negative) of the budget with every expert in memory:
    what does not fit stays in the quantized cache's files. The experts kept in memory are
    whole ones, the most used first where `routing` was measured; a token's routed experts
    are on disk in the share of its routings that land on the rest (uniform routing: the
    mapped share of the bytes). (0, 0) where even all experts on disk would not fit, or the
    disk would cost more than MAPPED_MIN_SPEED of the speed."""
    experts = shape.linear_bytes(p.weights, p.group_size, shape.expert_params)
    mapped = -short
    if mapped > experts:
        return 0, 0, 0
    routed = experts * shape.expert_fraction(1)
    if routing is not None and routing.experts:
        each = experts / routing.experts
        n = int((experts - mapped) // each)
        mapped = experts - int(n * each)
        from_disk = int(routed * routing.mapped_share(n))
    else:
        from_disk = int(routed * mapped / experts)
    read = shape.read_bytes(p.weights, p.group_size, head=p.head_format)
    if read / device_bw < MAPPED_MIN_SPEED * ((read - from_disk) / device_bw + from_disk / disk_bw):
        return 0, 0, 0
    return mapped, from_disk, experts - mapped


def streamed_units(shape: ModelShape, without_experts: bool = False) -> tuple[list[int], int, int]:
    """The bytes of the units a streamed target moves (decoder layers, then the output head
    in chunks of about a layer), the bytes always kept (final norm), and the embedding's
    bytes when it is a separate matrix (0 when tied to the head). `without_experts`: a
    mixture's layers hold all but their routed experts."""
    dt = shape.dtype_bytes
    linear = shape.linear_params - (shape.expert_params if without_experts else 0)
    layer = linear // shape.layers * dt + (shape.other_params - shape.vocab * shape.hidden
                                          * (1 if shape.tied_embeddings else 2) - shape.hidden) // shape.layers * dt
    head = shape.vocab * shape.hidden * dt
    chunks = max(1, -(-head // max(layer, 1)))
    units = [layer] * shape.layers + [head // chunks] * chunks
    return units, shape.hidden * dt, 0 if shape.tied_embeddings else head


@dataclass(frozen=True)
class StreamPlacement:
    """Which units of a streamed target stay on the device, which are held in host memory
    and which are read from disk on every pass; and what that holds."""
    units: tuple[int, ...]           # bytes of each unit, in pass order
    resident: frozenset[int]         # unit positions kept on the device
    host: frozenset[int]
    embed_resident: bool
    buffer_bytes: int                # prefetch slots (+ staging)
    fixed_bytes: int
    embed_bytes: int
    min_budget: int                  # the least device memory this target can run in
    fits: bool

    @property
    def disk(self) -> frozenset[int]:
        return frozenset(range(len(self.units))) - self.resident - self.host

    @property
    def resident_bytes(self) -> int:
        return sum(self.units[i] for i in self.resident)

    @property
    def host_streamed_bytes(self) -> int:
        return sum(self.units[i] for i in self.host)

    @property
    def disk_streamed_bytes(self) -> int:
        return sum(self.units[i] for i in self.disk)

    @property
    def streamed_bytes(self) -> int:
        return self.host_streamed_bytes + self.disk_streamed_bytes

    @property
    def device_bytes(self) -> int:
        return (self.fixed_bytes + self.resident_bytes + self.buffer_bytes
                + (self.embed_bytes if self.embed_resident else 0))

    def resident_layers(self, layers: int) -> int:
        return sum(1 for i in self.resident if i < layers)

    def host_layers(self, layers: int) -> int:
        return sum(1 for i in self.host if i < layers)


def place_streamed(units: list[int], slot_bytes: int, fixed_bytes: int, embed_bytes: int, budget: int,
                   host_budget: int = 0, depth: int = PREFETCH_DEPTH, staging_bytes: int = 0,
                   host_units: list[int] | None = None) -> StreamPlacement:
    """Decide the tiers. Resident units are spread evenly over the pass, so the reader
    fetches the next streamed unit while a resident one computes. The embedding goes
    last: a token needs one row of it, which streaming reads for almost nothing.
    `host_units`: a unit's size in host memory (its bytes in the file), if not `units`."""
    n, total = len(units), sum(units)
    every = frozenset(range(n))
    if fixed_bytes + total + embed_bytes <= budget:
        return StreamPlacement(tuple(units), every, frozenset(), True, 0, fixed_bytes, embed_bytes,
                               fixed_bytes + depth * (slot_bytes + staging_bytes), True)
    buffers = depth * (slot_bytes + staging_bytes)
    minimum = fixed_bytes + buffers
    room = budget - minimum
    resident: set[int] = set()
    if room > 0:
        k = min(n, room // max(units))
        resident = {int((j + 0.5) * n / k) for j in range(k)} if k else set()
        # Spare room after the even spread (units differ a little in size): take more in order.
        for i in range(n):
            used = sum(units[j] for j in resident)
            if i not in resident and used + units[i] <= room:
                resident.add(i)
    host, used = set(), 0
    sizes = host_units or units
    for i in range(n):
        if i not in resident and used + sizes[i] <= host_budget:
            host.add(i)
            used += sizes[i]
    return StreamPlacement(tuple(units), frozenset(resident), frozenset(host), False, buffers, fixed_bytes,
                           embed_bytes, minimum, room >= 0)


def gb(n: float, digits: int = 3) -> str:
    """A size with `digits` significant figures in the largest unit it reaches: 232 MB,
    1.54 GB, 14.2 GB, 640 KB."""
    a = abs(n)
    if a == 0:
        return "0"
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if a >= scale or unit == "KB":
            v = n / scale
            places = max(0, digits - len(str(int(abs(v)))))
            return f"{v:.{places}f} {unit}"
    return f"{n} B"


def gb_apart(a: float, b: float) -> tuple[str, str]:
    """Two sizes printed with enough figures to differ (a need and a budget: "needs 0.2 GB
    but the budget is 0.2 GB" says nothing)."""
    for digits in range(3, 10):
        x, y = gb(a, digits), gb(b, digits)
        if x != y or a == b:
            return x, y
    return gb(a, 10), gb(b, 10)


def format_plan(plan: Plan) -> str:
    # A hybrid's recurrent state is its own column (per conversation, not per token).
    hybrid = any(r.state for r in plan.rows)
    head = (f"{'profile':<16} {'weights':>9} {'read/tok':>9} {'KV':>9} " + (f"{'state':>9} " if hybrid else "")
            + f"{'drafter':>8} {'act':>8} {'runtime':>8} {'margin':>7} "
            f"{'total':>9} {'budget':>9} {'fits':>4} {'streamed/pass':>13} {'tok/s ≤':>8}")
    lines = [head]

    def fits(r) -> str:
        return "n/a" if r.profile in plan.not_runnable else "yes" if r.fits else "no"
    for r in plan.rows:
        mark = "→ " if r.profile == plan.chosen else "  "
        state = f"{gb(r.state):>9} " if hybrid else ""
        lines.append(f"{mark}{r.profile:<14} {gb(r.weights):>9} {gb(r.read_per_token):>9} {gb(r.kv):>9} "
                     f"{state}{gb(r.drafter):>8} "
                     f"{gb(r.activations):>8} {gb(r.runtime):>8} {gb(r.margin):>7} {gb(r.total):>9} "
                     f"{gb(r.budget):>9} {fits(r):>4} {gb(r.streamed_bytes_per_pass):>13} "
                     f"{r.tps_bound:>8.1f}")
    lines.append("")
    for r in plan.rows:
        if r.streamed_bytes_per_pass and r.fits and r.profile not in plan.not_runnable:
            lines.append(f"{r.profile}: {r.resident_layers} of {r.resident_layers + r.host_layers + r.disk_layers} "
                         f"layers stay on the device, {r.host_layers} are held in host RAM, {r.disk_layers} are read "
                         f"from disk; each pass streams {gb(r.streamed_bytes_per_pass)} (a verify pass of k+1 "
                         "tokens streams it once).")
    for r in plan.rows:
        if r.mapped_experts and r.fits and r.profile not in plan.not_runnable and r.placement == "streamed":
            lines.append(f"{r.profile}: the routed experts ({gb(r.mapped_experts)}) are read where they lie in the "
                         f"checkpoint's files, memory-mapped: only those a token routes to; the page cache can hold "
                         f"{gb(r.kept_experts)} of them, so a token reads about {gb(r.disk_per_token)} from disk.")
        elif r.mapped_experts and r.fits and r.profile not in plan.not_runnable:
            kept = (f"the most used stay in memory (routing measured on {r.routing_tokens} held tokens)"
                    if r.routing_tokens else "which stay in memory is measured at the first load; uniform routing "
                                             "assumed until then")
            lines.append(f"{r.profile}: {gb(r.mapped_experts)} of the experts stay memory-mapped in the quantized "
                         f"cache on disk, {kept}; a token reads about {gb(r.disk_per_token)} of its experts "
                         "from there.")
    if any(r.read_per_token < r.weights // 2 for r in plan.rows if r.placement == "resident"):
        lines.append("read/tok: what one token reads; a mixture of experts reads only its routed experts "
                     "(a verify pass of n tokens, the distinct experts they route to).")
    if plan.not_runnable:
        lines.append(f"n/a: this version has no target for {', '.join(plan.not_runnable)} on this model "
                     "(shown for what it would need).")
    lines.append(plan.reason)
    return "\n".join(lines)
