"""The rank layer: one process per rank (the worker, the LightningModule, callbacks, fault injection
and guard, the rank's checkpointing). Imports framework.base only, never framework.driver."""
