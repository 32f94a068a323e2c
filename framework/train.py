"""``python -m framework.train``: the documented command; it runs :mod:`framework.driver.train` (the code lives there).

The rank server starts first, before the driver imports Hydra (:func:`framework.driver.launcher.start_rank_server_early`).

The driver runs as ``__main__`` without replacing this module in ``sys.modules`` (``alter_sys=False``): a rank
forked from the rank server re-runs the parent's main module by name before its target (multiprocessing's
``spawn.prepare``), and this module's body costs nothing there, where :mod:`framework.driver.train` would import
Hydra and the driver into every rank (~0.2 s of CPU per rank on the 2-core machine).
"""

import runpy
import sys

if __name__ == "__main__":
    from framework.driver.launcher import start_rank_server_early

    start_rank_server_early(sys.argv[1:])
    runpy.run_module("framework.driver.train", run_name="__main__")
