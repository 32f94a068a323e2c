"""``python -m framework.compare``: the documented command; it runs :mod:`framework.driver.compare` (the code lives there)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.driver.compare", run_name="__main__", alter_sys=True)
