"""The rank layer's modules of the former ``framework/metrics/`` folder (the other layers hold the rest of it)."""
