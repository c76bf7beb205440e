"""Tiered checkpoints: a node-local fast tier written first, the durable tier filled behind it."""
