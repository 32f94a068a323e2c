"""Hydra SearchPathPlugin: adds ``trainlab_example_plugin/conf`` to Hydra's config search path.

Hydra discovers every module under the ``hydra_plugins`` namespace package (no ``__init__.py``
in ``hydra_plugins/`` itself), so installing this package is enough for
``python -m framework.train parallelism=ddp_rsag`` to compose ``conf/parallelism/ddp_rsag.yaml``.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TrainlabExamplePluginSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="trainlab-example-plugin", path="pkg://trainlab_example_plugin/conf")
