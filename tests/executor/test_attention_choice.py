"""Which attention the executor runs in decode and in prefill: the CPU's FFI handlers where
they can (CPU, fp32, the kernel's XLA path), the ragged paged attention kernel elsewhere;
"cpu" asked for where it cannot run is refused with the reason, naming the option."""

import jax
import pytest

from conflux_jax.executor.jax_executor import resolve_attention
from pallas_kernels.cpu_attention import paged_attention_available

needs_cpu = pytest.mark.skipif(jax.default_backend() != "cpu" or
                               not paged_attention_available()[0], reason="the CPU handler")
OPTIONS = pytest.mark.parametrize("option", ["decode_attention", "prefill_attention"])


@needs_cpu
@OPTIONS
@pytest.mark.parametrize(("impl", "want"), [(None, "cpu"), ("xla", "cpu"),
                                            ("interpret", "rpa")])
def test_auto_takes_the_handler_only_where_the_kernel_would_take_its_xla_path(option, impl,
                                                                             want):
    assert resolve_attention(option, "auto", "cpu", "float32", impl) == want


@OPTIONS
def test_auto_elsewhere_is_the_kernel(option):
    assert resolve_attention(option, "auto", "cpu", "bfloat16", None) == "rpa"
    assert resolve_attention(option, "auto", "gpu", "float32", None) == "rpa"
    assert resolve_attention(option, "rpa", "cpu", "float32", None) == "rpa"


@OPTIONS
@pytest.mark.parametrize(("platform", "dtype", "why"), [
    ("cpu", "bfloat16", "fp32 only"), ("gpu", "float32", "CPU only")])
def test_cpu_where_it_cannot_run_is_refused(option, platform, dtype, why):
    with pytest.raises(ValueError, match=f"{option}='cpu' cannot run: .*{why}"):
        resolve_attention(option, "cpu", platform, dtype, None)


@OPTIONS
def test_an_unknown_choice_is_refused(option):
    with pytest.raises(ValueError, match=f"{option} must be one of"):
        resolve_attention(option, "flash", "cpu", "float32", None)
