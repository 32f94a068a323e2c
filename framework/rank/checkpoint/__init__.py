"""The rank layer's modules of the former ``framework/checkpoint/`` folder (the other layers hold the rest of it)."""
