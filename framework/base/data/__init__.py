"""The base layer's modules of the former ``framework/data/`` folder (the other layers hold the rest of it)."""
