"""ckptio's benchmark suite: ``python -m benchmarks`` or ``ckptio bench``."""
