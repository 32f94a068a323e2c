"""``python -m framework.checkpoint``: the documented command; it runs :mod:`framework.base.checkpoint` (the code lives there)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.base.checkpoint", run_name="__main__", alter_sys=True)
