"""Typed schema of a trainlab run.

Every Hydra config group has a dataclass here; YAML files under ``conf/`` only hold values.
Single-field checks live in ``__post_init__`` (they run when ``OmegaConf.to_object`` builds
the dataclasses); cross-field rules and derived values live in
:func:`framework.driver.validate.validate`. Every failure is a :class:`ConfigError` whose
message names the key and what is allowed.

The ``parallelism`` node is special: each plugin brings its own config dataclass (a subclass
of :class:`ParallelConfig`), so the schema types it loosely and ``validate`` converts it with
the plugin's class once the plugin is known by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value. The message is one line naming the key(s) and what is allowed."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


MODEL_ARCHS = ("gpt", "llama")
# The shape keys each architecture trains with (framework/driver/validate.py; the planner takes any).
ARCH_SHAPE = {
    "gpt": {"mlp": "gelu", "tied_embeddings": True, "learned_positions": True, "n_kv_head": None},
    "llama": {"mlp": "swiglu", "tied_embeddings": False, "learned_positions": False, "bias": False},
}


@dataclass
class ModelConfig:
    """Decoder shape: ``arch=gpt`` (pre-norm, causal attention, GELU MLP, learned positions, tied
    embeddings; framework/base/model/gpt.py) or ``arch=llama`` (RMSNorm, RoPE, SwiGLU, grouped-query
    attention, untied head, no biases; framework/base/model/llama.py)."""

    name: str = "gpt_tiny"  # preset name, logged as a param
    arch: str = "gpt"  # gpt | llama: which decoder trains (the shape keys below must match it, validate.py)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads; must divide d_model
    d_model: int = 128  # hidden size h
    d_ff: int | None = None  # MLP inner size; None = 4 * d_model
    max_seq_len: int = 256  # longest sequence the position embedding covers (tokens)
    vocab_size: int | None = None  # None = the tokenizer's vocabulary size
    dropout: float = 0.0  # 0 keeps runs bitwise reproducible across batch splits
    bias: bool = True  # biases in Linear and LayerNorm
    init_std: float = 0.02  # std of the normal init (GPT-2)
    activation_checkpointing: bool = (
        False  # recompute each block's forward in backward (torch.utils.checkpoint): less memory, +1 forward
    )
    # Shape keys that tell the architectures apart; the planner (python -m framework.plan) sizes any
    # combination, training needs the combination of model.arch (framework/driver/validate.py).
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None = n_head
    mlp: str = "gelu"  # gelu (2 matrices h x d_ff; arch=gpt) | swiglu (3 matrices; arch=llama)
    tied_embeddings: bool = True  # output head = token embedding (arch=gpt); False = an untied head (arch=llama)
    learned_positions: bool = True  # learned position embedding (arch=gpt); False = rotary (arch=llama)
    rope_theta: float = 10000.0  # rotary base (arch=llama; Llama 2: 1e4, Llama 3: 5e5)
    norm_eps: float = 1e-5  # RMSNorm epsilon (arch=llama)

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_head", "d_model", "max_seq_len"):
            _require(getattr(self, key) > 0, f"model.{key}={getattr(self, key)} must be > 0")
        _require(
            self.d_model % self.n_head == 0,
            f"model.n_head={self.n_head} must divide model.d_model={self.d_model}",
        )
        _require(self.d_ff is None or self.d_ff > 0, f"model.d_ff={self.d_ff} must be > 0 or null")
        _require(
            self.vocab_size is None or self.vocab_size > 0,
            f"model.vocab_size={self.vocab_size} must be > 0 or null (= tokenizer size)",
        )
        _require(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        _require(self.mlp in ("gelu", "swiglu"), f"model.mlp={self.mlp!r} is not allowed; allowed: gelu, swiglu")
        _require(
            self.arch in MODEL_ARCHS, f"model.arch={self.arch!r} is not allowed; allowed: {', '.join(MODEL_ARCHS)}"
        )
        _require(
            self.n_kv_head is None or (self.n_kv_head > 0 and self.n_head % self.n_kv_head == 0),
            f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head} (or be null)",
        )


DATA_SOURCES = ("stdlib_code", "text_files", "jsonl")
DATA_MODES = ("memmap", "on_the_fly")


@dataclass
class DataConfig:
    """Corpus, tokenizer and loader settings."""

    name: str = "stdlib_code"  # one of DATA_SOURCES
    paths: list[str] = field(default_factory=list)  # globs of files (text_files, jsonl)
    text_field: str = "text"  # JSONL field holding the document text
    seq_len: int = 128  # tokens per training window (a window holds seq_len + 1 tokens)
    vocab_size: int = 4096  # byte-level BPE vocabulary size
    val_fraction: float = 0.02  # fraction of files (documents for jsonl) held out for validation
    max_bytes: int | None = None  # cap on corpus bytes read (None = all)
    cache_dir: str = ".cache/trainlab"  # tokenizer and token caches (relative to the working dir)
    num_workers: int = 0  # DataLoader worker processes per rank
    mode: str = "memmap"  # memmap: pre-tokenized windows | on_the_fly: BPE of the raw text in the loader (same windows)
    prefetch_factor: int | None = None  # batches each worker loads ahead (needs num_workers > 0); None = torch's 2
    pin_memory: bool | None = (
        None  # page-locked host batches (faster host->GPU copies); None = on when CUDA is available
    )
    seed: int = 1234  # shuffling seed (same on every rank)
    mask_document_boundaries: bool = (
        False  # no loss on the target after each <|endoftext|> (the next document's first token)
    )

    def __post_init__(self) -> None:
        _require(
            self.name in DATA_SOURCES,
            f"data.name={self.name!r} is not a data source; allowed: {', '.join(DATA_SOURCES)}",
        )
        _require(self.seq_len > 0, f"data.seq_len={self.seq_len} must be > 0")
        _require(self.vocab_size >= 260, f"data.vocab_size={self.vocab_size} must be >= 260 (256 bytes + specials)")
        _require(0.0 < self.val_fraction < 0.5, f"data.val_fraction={self.val_fraction} must be in (0, 0.5)")
        _require(self.num_workers >= 0, f"data.num_workers={self.num_workers} must be >= 0")
        _require(self.mode in DATA_MODES, f"data.mode={self.mode!r} is not allowed; allowed: {', '.join(DATA_MODES)}")
        _require(
            self.prefetch_factor is None or self.prefetch_factor > 0,
            f"data.prefetch_factor={self.prefetch_factor} must be > 0 or null",
        )
        _require(
            self.prefetch_factor is None or self.num_workers > 0,
            f"data.prefetch_factor={self.prefetch_factor} needs data.num_workers > 0 (got {self.num_workers}); set it to null",
        )
        _require(self.max_bytes is None or self.max_bytes > 0, f"data.max_bytes={self.max_bytes} must be > 0 or null")
        if self.name in ("text_files", "jsonl"):
            _require(len(self.paths) > 0, f"data.paths is empty; data.name={self.name} needs at least one file or glob")


@dataclass
class ParallelConfig:
    """Fields every parallelism plugin shares. Plugins subclass this with their own options.

    ``world_size = dp_degree * tp_degree * pp_degree``; ``dp_degree = -1`` derives it.
    """

    name: str = "single"  # registry name of the plugin (== conf/parallelism/<name>.yaml)
    world_size: int = 1  # total ranks (nnodes * ranks per node)
    nnodes: int = 1  # nodes; ranks per node = world_size / nnodes
    nproc_per_node: int | None = (
        None  # ranks per node; null = world_size / nnodes (given: nnodes x nproc_per_node must be world_size)
    )
    dp_degree: int = -1  # data-parallel degree; -1 = world_size / (tp_degree * pp_degree)
    tp_degree: int = 1  # tensor-parallel degree
    pp_degree: int = 1  # pipeline-parallel degree
    backend: str = "auto"  # process-group backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: int = 600  # collective timeout before a hung rank is reported (seconds)

    def __post_init__(self) -> None:
        _require(self.world_size > 0, f"parallelism.world_size={self.world_size} must be > 0")
        _require(self.nnodes > 0, f"parallelism.nnodes={self.nnodes} must be > 0")
        _require(
            self.nproc_per_node is None or self.nproc_per_node > 0,
            f"parallelism.nproc_per_node={self.nproc_per_node} must be > 0 or null (world_size / nnodes)",
        )
        _require(
            self.nproc_per_node is None or self.nnodes * self.nproc_per_node == self.world_size,
            f"parallelism.nnodes={self.nnodes} x parallelism.nproc_per_node={self.nproc_per_node}"
            f" = {self.nnodes * (self.nproc_per_node or 0)} != parallelism.world_size={self.world_size}",
        )
        _require(
            self.dp_degree == -1 or self.dp_degree > 0,
            f"parallelism.dp_degree={self.dp_degree} must be > 0 or -1 (derive)",
        )
        _require(self.tp_degree > 0, f"parallelism.tp_degree={self.tp_degree} must be > 0")
        _require(self.pp_degree > 0, f"parallelism.pp_degree={self.pp_degree} must be > 0")
        _require(
            self.backend in ("auto", "gloo", "nccl"),
            f"parallelism.backend={self.backend!r} is not allowed; allowed: auto, gloo, nccl",
        )
        _require(self.timeout_s > 0, f"parallelism.timeout_s={self.timeout_s} must be > 0")


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


@dataclass
class TrainerConfig:
    """Loop length, batch arithmetic and Lightning Trainer options.

    Give any two of ``global_batch_size``, ``micro_batch_size`` and ``grad_accum_steps``
    (in sequences; dp_degree comes from parallelism); the third is derived.
    """

    max_steps: int = 800  # optimizer steps
    micro_batch_size: int | None = 8  # sequences per rank per forward/backward
    global_batch_size: int | None = 16  # sequences per optimizer step, all ranks
    grad_accum_steps: int | None = None  # micro-batches per optimizer step per rank
    seed: int = 1234  # model init and every RNG (same on all ranks)
    precision: str = "32-true"  # one of PRECISIONS
    accelerator: str = "auto"  # auto | cpu | cuda
    log_every_n_steps: int = 10  # optimizer steps between MLflow metric writes
    val_every_n_steps: int = 100  # optimizer steps between validation passes (also at start and end)
    val_sequences: int = 128  # validation windows per pass, over all ranks (same set for every layout)
    warmup_steps_excluded: int = 3  # first steps left out of throughput / MFU (warm-up)
    threads_per_rank: int | None = None  # CPU threads per rank; None = cores // local ranks
    max_restarts: int = 0  # elastic agent restarts of failed ranks
    stop_grace_s: int = (
        30  # seconds the ranks get to finish the step and save after SIGTERM/SIGUSR1 (or Ctrl-C) reaches the driver
    )
    preload_ranks: bool = (
        True  # start ranks from a forkserver with torch/Lightning imported (started early; cheaper restarts)
    )
    progress_bar: bool = True  # tqdm bar on rank 0
    profile_steps: list[int] | None = (
        None  # [a, b]: torch.profiler trace of optimizer steps a..b (MLflow artifact); None = off
    )
    compile: bool = False  # torch.compile the model (nn.Module.compile: checkpoints keep their keys)
    count_host_syncs: bool = (
        False  # log perf/host_syncs per step and write host_syncs.json (a diagnostic: slows the run)
    )

    def __post_init__(self) -> None:
        _require(self.max_steps > 0, f"trainer.max_steps={self.max_steps} must be > 0")
        for key in ("micro_batch_size", "global_batch_size", "grad_accum_steps"):
            v = getattr(self, key)
            _require(v is None or v > 0, f"trainer.{key}={v} must be > 0 or null (derived)")
        _require(
            self.precision in PRECISIONS,
            f"trainer.precision={self.precision!r} is not allowed; allowed: {', '.join(PRECISIONS)}",
        )
        _require(
            self.accelerator in ("auto", "cpu", "cuda"),
            f"trainer.accelerator={self.accelerator!r} is not allowed; allowed: auto, cpu, cuda",
        )
        _require(self.log_every_n_steps > 0, f"trainer.log_every_n_steps={self.log_every_n_steps} must be > 0")
        _require(self.val_every_n_steps > 0, f"trainer.val_every_n_steps={self.val_every_n_steps} must be > 0")
        _require(self.val_sequences >= 0, f"trainer.val_sequences={self.val_sequences} must be >= 0")
        _require(
            self.warmup_steps_excluded >= 0, f"trainer.warmup_steps_excluded={self.warmup_steps_excluded} must be >= 0"
        )
        _require(
            self.threads_per_rank is None or self.threads_per_rank > 0,
            f"trainer.threads_per_rank={self.threads_per_rank} must be > 0 or null",
        )
        _require(self.max_restarts >= 0, f"trainer.max_restarts={self.max_restarts} must be >= 0")
        _require(self.stop_grace_s >= 0, f"trainer.stop_grace_s={self.stop_grace_s} must be >= 0 (seconds)")
        if self.profile_steps is not None:
            ps = list(self.profile_steps)
            _require(
                len(ps) == 2 and 1 <= ps[0] <= ps[1] <= self.max_steps,
                f"trainer.profile_steps={ps} must be [a, b] with 1 <= a <= b <= trainer.max_steps={self.max_steps}, or null",
            )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay, counted in applied optimizer updates (a dropped step does not count)."""

    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    warmup_steps: int = 20  # applied optimizer updates of linear warm-up from 0
    weight_decay: float = 0.1  # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad L2 norm; 0 disables clipping

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
            f"optim.beta1/beta2=({self.beta1}, {self.beta2}) must be in [0, 1)",
        )
        _require(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0")


CHECKPOINT_MODES = ("sync", "async")


@dataclass
class CheckpointConfig:
    """Where, how often and how full training state is saved (see framework/checkpoint/)."""

    name: str = "interval"  # policy preset name (== conf/checkpoint/<name>.yaml), logged as a param
    dir: str | None = None  # None = checkpoints/<experiment_name>/<run_name> (stable per run)
    every_n_steps: int = 100  # optimizer steps between saves; 0 disables periodic saves
    keep_last_k: int = 2  # newest complete checkpoints kept; older ones are deleted
    save_last: bool = True  # also save when training ends
    mode: str = "sync"  # sync: the step waits for the whole write | async: only for a copy to CPU
    full_every_n_saves: int = 1  # 1 = every save full; K > 1 = a full base every K saves, XOR deltas between
    memory_every_n_steps: int = 0  # in-RAM snapshot (for rollback) every N optimizer steps; 0 = off

    def __post_init__(self) -> None:
        _require(self.every_n_steps >= 0, f"checkpoint.every_n_steps={self.every_n_steps} must be >= 0")
        _require(self.keep_last_k > 0, f"checkpoint.keep_last_k={self.keep_last_k} must be > 0")
        _require(
            self.mode in CHECKPOINT_MODES,
            f"checkpoint.mode={self.mode!r} is not allowed; allowed: {', '.join(CHECKPOINT_MODES)}",
        )
        _require(
            self.full_every_n_saves > 0,
            f"checkpoint.full_every_n_saves={self.full_every_n_saves} must be > 0 (1 = no deltas)",
        )
        _require(
            self.memory_every_n_steps >= 0,
            f"checkpoint.memory_every_n_steps={self.memory_every_n_steps} must be >= 0 (0 = off)",
        )


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    uri: str = "sqlite:///mlruns.db"  # any MLflow tracking URI (sqlite file, file store, http server)
    enabled: bool = True  # False: no MLflow at all (metrics still printed)
    system_metrics_interval_s: float = 10.0  # seconds between MLflow system metrics samples (CPU, memory, GPU); 0 = off
    load_interval_s: float = (
        5.0  # seconds between load samples (framework/base/load_monitor.py: load/* metrics); 0 = off
    )
    contended_cpu_share: float = 0.10  # mean CPU share of other processes from which a run is tagged contended=true

    def __post_init__(self) -> None:
        _require(self.load_interval_s >= 0, f"tracking.load_interval_s={self.load_interval_s} must be >= 0 (0 = off)")
        _require(
            0 < self.contended_cpu_share <= 1,
            f"tracking.contended_cpu_share={self.contended_cpu_share} must be in (0, 1] (a fraction of all cores)",
        )
        _require(
            self.system_metrics_interval_s >= 0,
            f"tracking.system_metrics_interval_s={self.system_metrics_interval_s} must be >= 0 (0 = off)",
        )


# ---- faults and resilience (framework/faults/) ------------------------------------------------
RESILIENCE_POLICIES = ("none", "skip_step", "rollback", "restart", "shrink", "abort")
SHRINK_BATCH = ("keep", "scale")  # resilience.shrink_batch: what a shrink does to the global batch


@dataclass
class FaultEventConfig:
    """One scheduled fault: ``kind`` fires once, during optimizer step ``step`` (1-based), on ``ranks``."""

    kind: str = (
        "nan_grad"  # a registered fault kind (framework/base/faults/kinds/; checked by framework.base.faults.schedule)
    )
    step: int = 1  # optimizer step (1-based) in which it fires; never again when the step is replayed
    ranks: list[int] = field(
        default_factory=lambda: [1]
    )  # global ranks it hits (checkpoint faults: the writer, rank 0)
    factor: float = 10.0  # loss_spike: multiplier of the loss on the faulty ranks
    delay_s: float = 0.5  # slow_rank: extra seconds per step; hang: seconds the rank stops answering
    duration_steps: int = 1  # slow_rank: steps the rank stays slow

    def __post_init__(self) -> None:
        _require(self.step >= 1, f"fault.events.step={self.step} must be >= 1 (optimizer steps count from 1)")
        _require(
            len(self.ranks) > 0 and all(r >= 0 for r in self.ranks),
            f"fault.events.ranks={list(self.ranks)} must be a non-empty list of ranks >= 0",
        )
        _require(self.factor > 0, f"fault.events.factor={self.factor} must be > 0")
        _require(self.delay_s >= 0, f"fault.events.delay_s={self.delay_s} must be >= 0")
        _require(self.duration_steps >= 1, f"fault.events.duration_steps={self.duration_steps} must be >= 1")


@dataclass
class FaultConfig:
    """What goes wrong, and when: a list of events and/or a seeded random process (MTBF in steps)."""

    name: str = "none"  # preset name (== conf/fault/<name>.yaml), logged as a param
    events: list[FaultEventConfig] = field(default_factory=list)  # scheduled faults, each fires once
    mtbf_steps: float = 0.0  # random process: mean optimizer steps between faults (exponential gaps); 0 = off
    random_kinds: list[str] = field(
        default_factory=lambda: ["rank_crash"]
    )  # registered kinds the random process draws from
    random_seed: int = 0  # seed of the random process (same schedule every time)

    def __post_init__(self) -> None:
        _require(self.mtbf_steps >= 0, f"fault.mtbf_steps={self.mtbf_steps} must be >= 0 (0 = no random faults)")


@dataclass
class ResilienceConfig:
    """How faults are detected and what is done about them (see framework/faults/)."""

    name: str = "none"  # preset name (== conf/resilience/<name>.yaml), logged as a param
    policy: str = "none"  # one of RESILIENCE_POLICIES
    max_faults: int | None = None  # abort (run FAILED) once more faults than this are detected; None = no limit
    max_restarts: int = 3  # restart/shrink: elastic-agent restarts at one world size (none: trainer.max_restarts)
    min_world_size: int = 1  # shrink: never fewer ranks than this
    shrink_to: float | None = (
        None  # shrink: target world size: null = one rank less; (0, 1) = that fraction of the ranks (0.75: 4 -> 3); >= 1 = that many ranks
    )
    rewarmup_steps: int = 0  # shrink: linear LR re-warm-up over this many steps after shrinking; 0 = off
    shrink_batch: str = "keep"  # shrink: keep = global batch kept (grad_accum_steps re-derived); scale = grad_accum_steps kept, global batch and optim.lr scaled by new/old ranks
    skip_steps: list[int] = field(
        default_factory=list
    )  # optimizer steps whose update is always dropped (known-bad data)
    rollback_skip_window: bool = False  # rollback: drop the offending step's update when it is replayed (PaLM-style)
    grad_spike_factor: float = 0.0  # grad L2 norm > factor x its running mean = a fault; 0 = off (NaN/Inf always are)
    loss_spike_factor: float = 3.0  # step loss > factor x its running mean = a fault; 0 = off
    stat_warmup_steps: int = 5  # steps after a (re)start before spikes and stragglers are judged
    stat_beta: float = 0.9  # running mean: m = beta * m + (1 - beta) * x over accepted steps
    hang_timeout_s: float = 0.0  # watchdog: a rank without step progress this long exits (restart follows); 0 = off
    straggler_factor: float = (
        2.0  # a rank whose step time to the health check > factor x the others' median is a straggler; 0 = off
    )
    straggler_min_s: float = 0.05  # ... and is at least this many seconds slower (ignores noise on ms steps)
    audit_skips: bool = (
        False  # copy each rank's state at a dropped update; log max |after - before| (faults.jsonl skip_audit)
    )

    def __post_init__(self) -> None:
        _require(
            self.policy in RESILIENCE_POLICIES,
            f"resilience.policy={self.policy!r} is not a policy; allowed: {', '.join(RESILIENCE_POLICIES)}",
        )
        _require(
            self.max_faults is None or self.max_faults >= 0,
            f"resilience.max_faults={self.max_faults} must be >= 0 or null",
        )
        _require(self.max_restarts >= 0, f"resilience.max_restarts={self.max_restarts} must be >= 0")
        _require(self.min_world_size >= 1, f"resilience.min_world_size={self.min_world_size} must be >= 1")
        _require(self.rewarmup_steps >= 0, f"resilience.rewarmup_steps={self.rewarmup_steps} must be >= 0")
        _require(
            self.shrink_batch in SHRINK_BATCH,
            f"resilience.shrink_batch={self.shrink_batch!r} is not allowed; allowed: {', '.join(SHRINK_BATCH)}",
        )
        _require(
            self.shrink_to is None
            or 0 < self.shrink_to < 1
            or (self.shrink_to >= 1 and float(self.shrink_to).is_integer()),
            f"resilience.shrink_to={self.shrink_to} is not a target; allowed: null (one rank less), a fraction in"
            " (0, 1) of the ranks, or a whole number of ranks >= 1",
        )
        _require(
            all(s >= 1 for s in self.skip_steps), f"resilience.skip_steps={list(self.skip_steps)} must hold steps >= 1"
        )
        for key in ("grad_spike_factor", "loss_spike_factor", "straggler_factor"):
            v = getattr(self, key)
            _require(v == 0 or v > 1, f"resilience.{key}={v} must be > 1 (or 0 = off)")
        _require(self.stat_warmup_steps >= 0, f"resilience.stat_warmup_steps={self.stat_warmup_steps} must be >= 0")
        _require(0 <= self.stat_beta < 1, f"resilience.stat_beta={self.stat_beta} must be in [0, 1)")
        _require(self.straggler_min_s >= 0, f"resilience.straggler_min_s={self.straggler_min_s} must be >= 0")
        _require(self.hang_timeout_s >= 0, f"resilience.hang_timeout_s={self.hang_timeout_s} must be >= 0 (0 = off)")


@dataclass
class RendezvousConfig:
    """How the nodes of a multi-node run find each other (``parallelism.nnodes > 1``; docs/multinode.md).

    torch's static TCP rendezvous (the one ``torchrun --node-rank --master-addr`` uses): node 0's
    elastic agent hosts the store at ``endpoint``, every node's agent joins it, and node ``k``'s
    ranks are ``k * nproc_per_node .. (k+1) * nproc_per_node - 1``. Under Slurm (``SLURM_JOB_ID``
    set) a null value comes from its environment (:mod:`framework.driver.nodes`).
    """

    endpoint: str | None = (
        None  # host:port on node 0; null: 127.0.0.1 on a free port (1 node), $SLURM_LAUNCH_NODE_IPADDR:29500 under Slurm
    )
    id: str | None = None  # rendezvous id every node gives; null: $SLURM_JOB_ID, else <experiment_name>.<run_name>
    node_rank: int | None = (
        None  # this node, 0..nnodes-1 (node 0 owns the MLflow run and output folder); null: $SLURM_NODEID, else 0
    )
    timeout_s: int = 300  # seconds to wait for node 0's endpoint and for the other nodes

    def __post_init__(self) -> None:
        _require(self.timeout_s > 0, f"rendezvous.timeout_s={self.timeout_s} must be > 0 (seconds)")
        _require(
            self.node_rank is None or self.node_rank >= 0, f"rendezvous.node_rank={self.node_rank} must be >= 0 or null"
        )
        if self.endpoint is not None:
            host, _, port = self.endpoint.rpartition(":")
            _require(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                f"rendezvous.endpoint={self.endpoint!r} is not host:port (e.g. node0.cluster:29500)",
            )


@dataclass
class SlurmConfig:
    """What a job asks Slurm for under ``hydra/launcher=submitit_slurm`` / ``submitit_local``
    (hydra-submitit-launcher; the mapping is ``conf/hydra/launcher/*.yaml`` and :mod:`framework.driver.slurm`).

    Nodes come from ``parallelism.nnodes`` (one trainlab driver per node: ``tasks_per_node=1``),
    CPUs per task from the ranks per node and ``cpus_per_rank``, GPUs from the ranks per node
    when ``trainer.accelerator=cuda``. Ignored by the default (local) launcher.
    """

    partition: str | None = None  # Slurm partition; null: the cluster's default partition
    timeout_min: int = 60  # the job's time limit (minutes)
    signal_delay_s: int = 120  # Slurm sends submitit's signal (SIGUSR2) this many seconds before the time limit
    max_timeouts: int = 3  # requeues after reaching the time limit (preemptions requeue without limit)
    cpus_per_rank: int = 1  # CPU cores reserved per rank; trainer.threads_per_rank, when set, wins
    gpus_per_node: int | None = None  # null: the ranks per node with trainer.accelerator=cuda, else none
    mem_gb: int | None = None  # memory per node (GB); null: the partition's default

    def __post_init__(self) -> None:
        _require(self.timeout_min > 0, f"slurm.timeout_min={self.timeout_min} must be > 0 (minutes)")
        _require(self.signal_delay_s >= 0, f"slurm.signal_delay_s={self.signal_delay_s} must be >= 0 (seconds)")
        _require(self.max_timeouts >= 0, f"slurm.max_timeouts={self.max_timeouts} must be >= 0")
        _require(self.cpus_per_rank >= 1, f"slurm.cpus_per_rank={self.cpus_per_rank} must be >= 1")
        _require(
            self.gpus_per_node is None or self.gpus_per_node >= 0,
            f"slurm.gpus_per_node={self.gpus_per_node} must be >= 0 or null",
        )
        _require(self.mem_gb is None or self.mem_gb > 0, f"slurm.mem_gb={self.mem_gb} must be > 0 or null")


@dataclass
class SweepConfig:
    """Repeats of a sweep (``-m``; :mod:`framework.driver.repeats`, docs/sweeps.md). Ignored by a single run
    except ``repeat`` and ``label``, which only name it."""

    repeats: int = 1  # runs of each configuration of a sweep, interleaved (A B A B ...); >= 5 to rank them
    repeat: int = 0  # this job's repeat index (set by the sweep; the outer loop)
    label: str = ""  # a name that changes nothing trained: sweep it (sweep.label=a,b) for an A/A test

    def __post_init__(self) -> None:
        _require(self.repeats >= 1, f"sweep.repeats={self.repeats} must be >= 1 (runs of each configuration)")
        _require(self.repeat >= 0, f"sweep.repeat={self.repeat} must be >= 0")


RESUME_MODES = ("auto", "never")


@dataclass
class RunConfig:
    """The whole run, as composed by Hydra from ``conf/``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: Any = field(default_factory=lambda: {"name": "single"})  # converted by validate()
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)  # injected faults (framework/faults/)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)  # detection and recovery policy
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)  # how the nodes find each other (nnodes > 1)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # resources asked of Slurm (hydra/launcher=submitit_slurm)
    sweep: SweepConfig = field(default_factory=SweepConfig)  # repeats of a sweep (framework/driver/repeats.py)
    experiment_name: str = "default"  # MLflow experiment; experiment presets set it
    experiment_description: str = ""  # the MLflow experiment's description (a study's question); "" = left as it is
    run_name: str = "default"  # MLflow run name and checkpoint sub-folder (from the overrides)
    resume: str = "auto"  # auto (newest valid checkpoint in checkpoint.dir) | never | <path to a checkpoint folder>
    resume_allow_changed: list[str] = field(
        default_factory=list
    )  # keys that may differ from the resumed checkpoint's config

    def __post_init__(self) -> None:
        _require(bool(self.experiment_name), "experiment_name must not be empty")
        _require(bool(self.run_name), "run_name must not be empty")


def run_to_dict(run: RunConfig) -> dict[str, Any]:
    """The run as plain nested dicts (for YAML/JSON and MLflow params)."""
    return dataclasses.asdict(run)
