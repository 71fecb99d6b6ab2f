"""Which decode attention the executor runs: the CPU's FFI handler where it can (CPU, fp32,
the kernel's XLA path), the ragged paged attention kernel elsewhere; "cpu" asked for where
it cannot run is refused with the reason."""

import jax
import pytest

from conflux_jax.executor.jax_executor import resolve_decode_attention
from pallas_kernels.cpu_attention import paged_decode_available

needs_cpu = pytest.mark.skipif(jax.default_backend() != "cpu" or
                               not paged_decode_available()[0], reason="the CPU handler")


@needs_cpu
@pytest.mark.parametrize(("impl", "want"), [(None, "cpu"), ("xla", "cpu"),
                                            ("interpret", "rpa")])
def test_auto_takes_the_handler_only_where_the_kernel_would_take_its_xla_path(impl, want):
    assert resolve_decode_attention("auto", "cpu", "float32", impl) == want


def test_auto_elsewhere_is_the_kernel():
    assert resolve_decode_attention("auto", "cpu", "bfloat16", None) == "rpa"
    assert resolve_decode_attention("auto", "gpu", "float32", None) == "rpa"
    assert resolve_decode_attention("rpa", "cpu", "float32", None) == "rpa"


@pytest.mark.parametrize(("platform", "dtype", "why"), [
    ("cpu", "bfloat16", "fp32 only"), ("gpu", "float32", "CPU only")])
def test_cpu_where_it_cannot_run_is_refused(platform, dtype, why):
    with pytest.raises(ValueError, match=f"decode_attention='cpu' cannot run: .*{why}"):
        resolve_decode_attention("cpu", platform, dtype, None)


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        resolve_decode_attention("flash", "cpu", "float32", None)
