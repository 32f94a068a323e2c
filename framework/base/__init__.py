"""Shared base: no process of its own. Config schema and loading, the layout, the plugin contract and
registry, metric names and meters, checkpoint format and kinds, the fault schedule and log, the cost
formulas. Imported by the driver, the ranks and the plugins; imports neither (.importlinter)."""
