"""Hydra's entry to trainlab's Optuna search (``hydra/sweeper=optuna``; :mod:`framework.driver.search`).

Hydra instantiates sweepers only from classes under the ``hydra_plugins`` namespace package
(``hydra_plugins/`` has no ``__init__.py``), so this class lives here and hands everything to
:class:`framework.driver.search.OptunaSearch`.
"""

from __future__ import annotations

from typing import Any, Optional

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class TrainlabOptunaSweeper(Sweeper):
    """The Optuna sweeper with trainlab's failure semantics; the arguments are hydra-optuna-sweeper's."""

    def __init__(
        self,
        sampler: Any,
        direction: Any,
        storage: Any | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        search_space: DictConfig | None,
        custom_search_space: str | None,
        params: DictConfig | None,
    ) -> None:
        from framework.driver.search import OptunaSearch

        self.sweeper = OptunaSearch(
            sampler,
            direction,
            storage,
            study_name,
            n_trials,
            n_jobs,
            max_failure_rate,
            search_space,
            custom_search_space,
            params,
        )

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        return self.sweeper.sweep(arguments)
