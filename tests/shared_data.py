"""Data the tests read from outside the repository: the request traces in ``../shared``."""

import pytest

from conflux_jax.bench.workloads import traces_dir

# CI lays ../shared out beside the checkout; a bare clone elsewhere has no traces, and the
# tests that replay them say so instead of failing.
needs_traces = pytest.mark.skipif(
    not all((traces_dir() / f"{name}_trace.jsonl").is_file()
            for name in ("conversation", "synthetic")),
    reason=f"request traces not found in {traces_dir()} (set CONFLUX_TRACES_DIR)")
