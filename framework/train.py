"""``python -m framework.train``: the documented command; it runs :mod:`framework.driver.train` (the code lives there).

The rank server starts first, before the driver imports Hydra (:func:`framework.driver.launcher.start_rank_server_early`).
"""

import runpy
import sys

if __name__ == "__main__":
    from framework.driver.launcher import start_rank_server_early

    start_rank_server_early(sys.argv[1:])
    runpy.run_module("framework.driver.train", run_name="__main__", alter_sys=True)
