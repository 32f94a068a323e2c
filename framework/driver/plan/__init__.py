"""``python -m framework.plan``: which layout to buy and run, from the cost model (:mod:`framework.base.cost`)."""
