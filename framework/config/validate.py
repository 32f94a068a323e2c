"""Turn a composed config into a validated, frozen :class:`ResolvedRun`.

``load_run_config`` builds the typed dataclasses (single-field checks run in their
``__post_init__``); ``validate`` applies the cross-field rules, derives the batch arithmetic
and the parallel layout, and raises one :class:`ConfigError` listing every problem, before
any process group, rank or MLflow run exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.schema import ConfigError, ParallelConfig, RunConfig
from framework.registry import ParallelLayout, get_plugin_class


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    """One line from an OmegaConf error: ``full.key: first line of the message``."""
    if isinstance(err.__cause__, ConfigError):
        return str(err.__cause__)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "is not a ListConfig" in first:
        first += " (write a list: key=[a,b])"
    key = getattr(err, "full_key", None)
    return f"{key}: {first}" if key else first


def _to_object(schema: Any, node: Any) -> Any:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err)) from None


def load_run_config(cfg: DictConfig | Mapping[str, Any]) -> RunConfig:
    """Build typed dataclasses from a composed config (Hydra ``DictConfig`` or plain dict).

    The ``parallelism`` node is converted with its plugin's ``config_cls``.

    Raises:
        ConfigError: a wrong type, an unknown key or a value out of range; one line.
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    if "hydra" in cfg:
        del cfg["hydra"]
    par_node = cfg.pop("parallelism", None) or {"name": "single"}
    run: RunConfig = _to_object(RunConfig, cfg)
    name = par_node.get("name", "single")
    plugin_cls = get_plugin_class(str(name))
    allowed = {f.name for f in dataclasses.fields(plugin_cls.config_cls)}
    unknown = sorted(set(par_node.keys()) - allowed)
    if unknown:
        raise ConfigError(
            f"parallelism.{unknown[0]} is not an option of plugin {name!r}; allowed: {', '.join(sorted(allowed))}"
        )
    run.parallelism = _to_object(plugin_cls.config_cls, par_node)
    return run


@dataclass(frozen=True)
class ResolvedRun:
    """A validated run with every derived value (all counts in sequences unless noted).

    ``global_batch_size = micro_batch_size * grad_accum_steps * layout.dp``;
    ``tokens_per_step = global_batch_size * seq_len`` (tokens).
    """

    run: RunConfig
    layout: ParallelLayout
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    checkpoint_dir: str

    @property
    def plugin_name(self) -> str:
        return self.run.parallelism.name

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def nproc_per_node(self) -> int:
        return self.layout.world_size // self.run.parallelism.nnodes

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.run.data.seq_len

    def batch_summary(self) -> str:
        """Human-readable batch arithmetic, printed at start-up."""
        return (
            f"global_batch_size {self.global_batch_size} = micro_batch_size {self.micro_batch_size}"
            f" x grad_accum_steps {self.grad_accum_steps} x dp_degree {self.layout.dp}"
            f" | tokens/step {self.tokens_per_step:,} (seq_len {self.run.data.seq_len})"
            f" | world_size {self.world_size} = dp {self.layout.dp} x tp {self.layout.tp} x pp {self.layout.pp}"
        )


def derive_batch(
    *, micro_batch_size: int | None, global_batch_size: int | None, grad_accum_steps: int | None, dp_degree: int
) -> tuple[int, int, int]:
    """Derive (micro_batch_size, grad_accum_steps, global_batch_size) from any two of them.

    ``global_batch_size = micro_batch_size * grad_accum_steps * dp_degree``.

    Raises:
        ConfigError: fewer than two given, a remainder, or three given that disagree.
    """
    mbs, gbs, acc = micro_batch_size, global_batch_size, grad_accum_steps
    given = sum(v is not None for v in (mbs, gbs, acc))
    if given < 2:
        raise ConfigError(
            "trainer: give at least two of micro_batch_size, global_batch_size, grad_accum_steps "
            f"(got micro_batch_size={mbs}, global_batch_size={gbs}, grad_accum_steps={acc})"
        )
    if gbs is None:
        gbs = mbs * acc * dp_degree
    elif acc is None:
        if gbs % (mbs * dp_degree):
            raise ConfigError(
                f"trainer.global_batch_size={gbs} is not divisible by micro_batch_size {mbs} x dp_degree {dp_degree}"
                f" = {mbs * dp_degree}"
            )
        acc = gbs // (mbs * dp_degree)
    elif mbs is None:
        if gbs % (acc * dp_degree):
            raise ConfigError(
                f"trainer.global_batch_size={gbs} is not divisible by grad_accum_steps {acc} x dp_degree {dp_degree}"
                f" = {acc * dp_degree}"
            )
        mbs = gbs // (acc * dp_degree)
    if mbs * acc * dp_degree != gbs:
        raise ConfigError(
            f"trainer.global_batch_size={gbs} != micro_batch_size {mbs} x grad_accum_steps {acc} x dp_degree {dp_degree}"
            f" = {mbs * acc * dp_degree}; set one of them to null to derive it"
        )
    return mbs, acc, gbs


def _layout(par: ParallelConfig) -> ParallelLayout:
    tp, pp = par.tp_degree, par.pp_degree
    if par.dp_degree == -1:
        if par.world_size % (tp * pp):
            raise ConfigError(
                f"parallelism.world_size={par.world_size} is not divisible by tp_degree({tp}) x pp_degree({pp})"
            )
        dp = par.world_size // (tp * pp)
    else:
        dp = par.dp_degree
    if dp * tp * pp != par.world_size:
        raise ConfigError(
            f"parallelism.world_size={par.world_size} != dp_degree({dp}) x tp_degree({tp}) x pp_degree({pp}) = {dp * tp * pp}"
        )
    if par.nnodes != 1:
        raise ConfigError(f"parallelism.nnodes={par.nnodes}: only 1 node is supported yet (allowed: 1)")
    return ParallelLayout(dp=dp, tp=tp, pp=pp)


def validate(run: RunConfig) -> ResolvedRun:
    """Check cross-field rules and derive batch and layout.

    Raises:
        ConfigError: every violated rule, joined into one line with ``"; "``.
    """
    errors: list[str] = []

    def check(fn):
        try:
            return fn()
        except ConfigError as err:
            errors.append(str(err))
            return None

    layout = check(lambda: _layout(run.parallelism))
    batch = None
    if layout is not None:
        t = run.trainer
        batch = check(
            lambda: derive_batch(
                micro_batch_size=t.micro_batch_size,
                global_batch_size=t.global_batch_size,
                grad_accum_steps=t.grad_accum_steps,
                dp_degree=layout.dp,
            )
        )
    if run.data.seq_len > run.model.max_seq_len:
        errors.append(f"data.seq_len={run.data.seq_len} is longer than model.max_seq_len={run.model.max_seq_len}")
    if run.model.vocab_size is not None and run.model.vocab_size < run.data.vocab_size:
        errors.append(
            f"model.vocab_size={run.model.vocab_size} is smaller than data.vocab_size={run.data.vocab_size}"
            " (the tokenizer's); set it >= that or null"
        )
    if run.trainer.threads_per_rank is not None and layout is not None:
        import os

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        ranks = layout.world_size // run.parallelism.nnodes
        if run.trainer.threads_per_rank * ranks > cores and run.trainer.accelerator != "cuda":
            errors.append(
                f"trainer.threads_per_rank={run.trainer.threads_per_rank} x {ranks} ranks > {cores} cores: CPU ranks"
                f" would thrash; allowed: <= {max(1, cores // ranks)} (or null = cores // ranks)"
            )
    if run.trainer.accelerator == "cuda":
        import torch

        if not torch.cuda.is_available():
            errors.append("trainer.accelerator='cuda' but no CUDA device is visible; allowed here: auto, cpu")
    plugin = get_plugin_class(run.parallelism.name)(run.parallelism)
    check(lambda: plugin.validate(run))
    if layout is not None:
        from framework.faults.schedule import check_fault_config

        check(lambda: check_fault_config(run, layout.world_size, layout.tp, layout.pp))
    if errors:
        raise ConfigError("; ".join(errors))
    mbs, acc, gbs = batch
    ckpt_dir = run.checkpoint.dir or f"checkpoints/{run.experiment_name}/{run.run_name}"
    return ResolvedRun(
        run=run, layout=layout, micro_batch_size=mbs, grad_accum_steps=acc, global_batch_size=gbs, checkpoint_dir=ckpt_dir
    )


def run_to_dict(run: RunConfig) -> dict[str, Any]:
    """The run as plain nested dicts (for YAML/JSON and MLflow params)."""
    return dataclasses.asdict(run)
