"""An example trainlab parallelism plugin that lives outside the trainlab repository (see plugin.py)."""
