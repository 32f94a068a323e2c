"""``python -m framework.train``: the documented command; it runs :mod:`framework.driver.train` (the code lives there)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.driver.train", run_name="__main__", alter_sys=True)
