"""Imported last by the rank server (:data:`framework.driver.launcher.PRELOAD_MODULES`): freezes
(:func:`gc.freeze`) every object the preloaded imports made (~400k: torch, Lightning, the worker), as Python's
documentation of :func:`gc.freeze` advises before forking without ``exec``.

The ranks fork from the server. Without the freeze, a collection of the oldest generation in a rank walks those
objects and writes their GC headers, so the kernel copies the pages they sit on (copy-on-write) in every rank,
early in its life. The frozen objects are modules, classes and functions that live as long as the process anyway.
The figures: docs/benchmarks.md (start-up of a rank).

multiprocessing's forkserver runs nothing but imports before it serves, so this is a module.
"""

import gc

gc.freeze()
