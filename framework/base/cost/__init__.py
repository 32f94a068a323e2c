"""trainlab's cost model: pure functions of a model shape, a layout, a batch and the hardware.

One source of truth for what a layout costs. The parallelism plugins declare their modelled
bytes with it (``comm_volume``, ``model_states_bytes``); the planner (:mod:`framework.driver.plan`)
searches layouts of a cluster with it; the studies set it beside measurement.

- :mod:`.shape`        ModelShape: parameter counts by part, per layer, per TP rank
- :mod:`.memory`       model-state bytes per rank (DDP, ZeRO-1/2/3, FSDP, TP, PP; fp32 / bf16)
- :mod:`.activations`  activation memory per rank (Korthikanti et al. 2022, Table 2)
- :mod:`.comm`         every communication formula: ring wire bytes, each ZeRO stage's dp collectives, TP calls
                       per layer, and the plugins' payloads by kind summed from them
- :mod:`.collectives`  the planner's collectives of a layout by group and link (from :mod:`.comm`'s tables)
- :mod:`.bubble`       pipeline bubble (GPipe, 1F1B, interleaved 1F1B) and micro-batches in flight
- :mod:`.flops`        FLOPs per token and per step (PaLM App. B; Narayanan et al. eq. 3)
- :mod:`.hardware`     cluster specs from ``conf/cluster/`` (the local CPU measured by :mod:`framework.base.metrics.local_cpu`)
- :mod:`.steptime`     alpha-beta collective times, overlaps, step time, what-if
- :mod:`.layout`       PlanLayout: one candidate layout (degrees, schedule, micro-batch, sharding, recompute, SP);
                       a run's is :func:`framework.driver.plan.runs.plan_layout_of`
- :mod:`.estimate`     everything about one layout: memory, bytes, bubble, step time, tokens/s, MFU, cost
- :mod:`.interval`     checkpoint interval: Young, Daly, async and two-tier waste, incremental saves
- :mod:`.failure_sim`  seeded discrete-event failure simulator (goodput over seeds)
- :mod:`.whatif`       ``python -m framework.base.cost.whatif RUN_ID``: the what-if of a measured trainlab run
"""
