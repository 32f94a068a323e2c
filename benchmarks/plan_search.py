"""Wall time of the planner's layout search (``python -m framework.plan``), printed, not asserted.

    PYTHONPATH=$PWD python benchmarks/plan_search.py            # 1024 x 8 H100, GPT-3 175B
    PYTHONPATH=$PWD python benchmarks/plan_search.py 1024 llama3_405b

Prints layouts priced, layouts that fit, and the search's wall time (best of 3).
"""

from __future__ import annotations

import sys
import time

import yaml

from framework.base.config.schema import ModelConfig
from framework.base.cost.hardware import cluster_from_dict
from framework.base.cost.shape import ModelShape
from framework.driver.cli import CONF_DIR
from framework.driver.plan.search import search


def main() -> None:
    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    model = sys.argv[2] if len(sys.argv) > 2 else "gpt3_175b"
    cfg = ModelConfig(**yaml.safe_load((CONF_DIR / "model" / f"{model}.yaml").read_text()))
    shape = ModelShape.from_model_config(cfg, seq_len=2048)
    cluster = cluster_from_dict(yaml.safe_load((CONF_DIR / "cluster" / "h100_sxm.yaml").read_text()))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        res = search(shape, cluster, world=nodes * cluster.gpus_per_node, global_batch_size=1536)
        best = min(best, time.perf_counter() - t0)
    print(
        f"{model} on {nodes} x 8 h100_sxm: {res.evaluated} layouts priced, {len(res.fitting)} fit; "
        f"search wall time {best:.2f} s (best of 3)"
    )


if __name__ == "__main__":
    main()
