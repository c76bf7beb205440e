"""What a state dict holds, as saves and loads see it: canonical key names (``keys``) and per-rank
values (``per_rank``)."""
