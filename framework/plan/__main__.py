"""``python -m framework.plan``: the documented command; it runs :mod:`framework.driver.plan` (the code lives there)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.driver.plan", run_name="__main__", alter_sys=True)
