"""The rank layer's modules of the former ``framework/faults/`` folder (the other layers hold the rest of it)."""
