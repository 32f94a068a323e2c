"""Run a list of independent runs as Hydra sweeps: one driver and one rank server for many runs.

Every run started on its own pays the driver's imports (Hydra, torch: ~2.5 s of CPU on the 2-core
machine) and the rank server's (torch and Lightning: ~4.4 s) before its first step. A sweep pays
them once for all its jobs. Hydra's sweeper takes the product of the swept values, so runs that
differ in several keys at once become a config group of their own: each run is a file
``variant/<name>.yaml`` (package ``_global_``: its group choices as ``override /<group>: <option>``
in its defaults list before ``_self_``, its keys as values) in a folder put on Hydra's search path,
and the sweep is ``+variant=choice(<names>)`` (docs/sweeps.md, variants that are not a grid).

Used by the conformance suite (:meth:`framework.base.testing.conformance.Conformance.prefetch`) and
the integration tests' runner (``tests/integration/conftest.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def variant_yaml(overrides: Sequence[str]) -> str:
    """A ``# @package _global_`` config file that sets what the command-line ``overrides`` (``group=option``,
    ``key=value``; a value with ``=`` or ``,``, such as a sweep job's folder, quoted) set: group choices of
    ``conf/`` as ``override /<group>: <option>`` in its defaults list (before ``_self_``, so its values win),
    values by key.

    Raises:
        hydra.errors.OverrideParseException: an override Hydra's grammar does not parse.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from framework.base.config import CONF_DIR

    groups: list[dict[str, str]] = []
    values = OmegaConf.create({})
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.key_or_group
        if (CONF_DIR / key).is_dir():
            groups.append({f"override /{key}": str(o.value())})
        else:
            OmegaConf.update(values, key, o.value(), merge=True)
    return "# @package _global_\n" + OmegaConf.to_yaml(
        {"defaults": [*groups, "_self_"], **OmegaConf.to_container(values)}
    )


def run_variants(
    workdir: Path,
    fixed: Sequence[str],
    variants: Mapping[str, Sequence[str]],
    *,
    lanes: int = 2,
    timeout: float = 1800,
    experiment: str | None = None,
) -> dict[str, Path]:
    """Run ``variants`` (run name -> its overrides) with the overrides ``fixed`` common to all, as ``lanes``
    Hydra sweeps at once (each takes every ``lanes``-th run, in order), with ``cwd`` = ``workdir``.

    Each run's numbers are those it gives alone (its config is the same; only its run name, output and
    checkpoint folders differ): a sweep names its jobs, so run ``name``'s output folder is
    ``outputs/<experiment>/<sweep>/variant=<name>`` (``<experiment>``: ``variants<k>-<lane>``, new for each
    call) and an explicit ``checkpoint.dir`` gets ``<sweep>/variant=<name>`` appended (:func:`checkpoint_dir`
    reads the one it used). A lane's output is kept in ``variants<k>-<lane>/sweep.log``. ``lanes`` > 1 runs
    lanes side by side: use 1 where a run's timing is what is checked. ``experiment``: the MLflow experiment (and
    ``outputs/`` folder) of a one-lane batch instead of ``variants<k>-0``, for tests that read the experiment whole.

    Raises:
        ValueError: ``experiment`` with more than one lane (each lane's sweep needs its own experiment).

    Returns:
        run name -> output folder, for the runs that FINISHED (a refused or failed run is left out: its
        ``error.txt``, or the lane's ``sweep.log``, says why; :func:`job_folder` finds it).
    """
    names = list(variants)
    if not names:
        return {}
    lanes = max(1, min(lanes, len(names)))
    if experiment is not None and lanes > 1:
        raise ValueError(f"experiment={experiment!r} needs lanes=1 (got {lanes}): each lane's sweep has its own")
    k = len(list(Path(workdir).glob("variants*-0")))
    done: dict[str, Path] = {}

    def sweep(lane: int) -> None:
        folder = Path(workdir) / f"variants{k}-{lane}"
        group = folder / "variant"
        group.mkdir(parents=True)
        mine = names[lane::lanes]
        for name in mine:
            (group / f"{name}.yaml").write_text(variant_yaml(variants[name]))
        args = [
            sys.executable,
            "-m",
            "framework.train",
            "-m",
            *fixed,
            f"experiment_name={experiment or folder.name}",
            f"hydra.searchpath=[file://{folder}]",
            f"+variant=choice({','.join(mine)})",  # a sweep even of one run (its folder: variant=<name>)
        ]
        proc = subprocess.run(args, cwd=workdir, capture_output=True, text=True, timeout=timeout)
        (folder / "sweep.log").write_text(proc.stdout + proc.stderr)
        for name in mine:
            run_dir = job_folder(workdir, experiment or folder.name, name)
            outcome = run_dir / "sweep_outcome.json" if run_dir else None
            if outcome and outcome.is_file() and json.loads(outcome.read_text()).get("status") == "FINISHED":
                done[name] = run_dir

    with ThreadPoolExecutor(max_workers=lanes) as pool:
        list(pool.map(sweep, range(lanes)))
    return {name: done[name] for name in names if name in done}


def job_folder(workdir: Path, experiment: str, name: str) -> Path | None:
    """The output folder of variant ``name`` in the sweep of ``experiment`` (:func:`run_variants`), None if it has none."""
    found = sorted((Path(workdir) / "outputs" / experiment).glob(f"*/variant={name}"))
    return found[0] if found else None


def checkpoint_dir(run_dir: Path, workdir: Path) -> Path:
    """The checkpoint folder a run used (its ``launch.json``: the resolved ``checkpoint.dir``, relative to the
    driver's ``workdir`` unless absolute)."""
    return Path(workdir) / json.loads((Path(run_dir) / "launch.json").read_text())["resolved"]["checkpoint_dir"]
