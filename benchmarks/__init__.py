"""ckptio's benchmark suite: ``python -m benchmarks`` or ``ckptio bench``."""

import sys


def usage_error(message: str) -> None:
    """One line on stderr and exit code 2, as every ckptio command reports a bad argument."""
    print(f"ckptio bench: error: {message}", file=sys.stderr)
    raise SystemExit(2)
