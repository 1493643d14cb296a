"""The numerically sensitive tests again on torch's other CPU kernels (`ATEN_CPU_CAPABILITY`).

torch picks its CPU kernels once per process, by what the processor has (AVX-512, AVX2, or the
plain `default` ones), and a float32 reduction rounds by how the kernel splits its length into
vector lanes. A tolerance measured on one machine can hold there only: a float64 model whose
attention softmax runs in float32 matched to 1e-16 on an AVX-512 kernel and differed by 1.4e-8
on an AVX2 one. So `make test` runs the tests that compare such models (token outputs, traced
Hugging Face models, encoder-decoders, the graph-shape property test) once more under every
other kernel this CPU can run, and a tolerance that holds on one CPU only fails here first.

    python -m tests.cpu_paths            # every other kernel this CPU has
    python -m tests.cpu_paths avx2       # the ones named (skipped, saying so, if it lacks them)
"""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["CAPABILITIES", "SENSITIVE", "main", "native", "runs_as"]

CAPABILITIES = ("default", "avx2", "avx512")
# A few of each kind, so that the runs cost a minute or two, not the suite's twenty: every
# kind of comparison that a float32 part inside a float64 model can break.
_TOKENS = "tests/pipeline/runtime/test_tokens.py::"
_SEQ2SEQ = "tests/pipeline/splitting/test_encoder_decoder.py::test_encoder_decoder_trains_exactly"
SENSITIVE = [
    "tests/pipeline/runtime/test_token_outputs.py",
    _TOKENS + "test_exact_against_the_unsplit_model_on_the_padded_batch",
    _TOKENS + "test_a_split_llama_with_its_own_loss_is_exact_and_infers_in_order",
    _SEQ2SEQ + "[bart-zb-h1]",
    _SEQ2SEQ + "[t5-zb-v]",
    "tests/pipeline/splitting/test_traced_lengths.py::"
    "test_trains_and_infers_at_lengths_it_was_not_captured_at[llama]",
    "tests/test_transparency.py::test_any_stage_graph_equals_single_device",
]
_ENV = "ATEN_CPU_CAPABILITY"
_ASK = "import torch; print(torch.backends.cpu.get_cpu_capability())"


def runs_as(capability: str | None) -> str:
    """The kernels torch runs with `ATEN_CPU_CAPABILITY=capability` (None: unset), in lower
    case: a CPU without the asked ones falls back to what it has, so this tells which run."""
    env = {k: v for k, v in os.environ.items() if k != _ENV}
    if capability is not None:
        env[_ENV] = capability
    out = subprocess.run([sys.executable, "-c", _ASK], env=env, capture_output=True,
                         text=True, check=True).stdout
    return out.strip().lower()


def native() -> str:
    """The kernels torch picks on this CPU when nothing is set."""
    return runs_as(None)


def main(argv: list[str] | None = None) -> int:
    wanted = list(argv if argv is not None else sys.argv[1:]) or list(CAPABILITIES)
    unknown = sorted(set(wanted) - set(CAPABILITIES))
    if unknown:
        print(f"unknown kernels {unknown}: choose from {list(CAPABILITIES)}", file=sys.stderr)
        return 2
    own = native()
    worst = 0
    for capability in wanted:
        got = runs_as(capability)
        if got == own:
            print(f"cpu paths: {capability}: the native kernels ({own}), run by the suite itself")
            continue
        if got != capability:
            print(f"cpu paths: {capability}: this CPU lacks it (torch runs {got}): skipped")
            continue
        print(f"cpu paths: {capability} ({_ENV}={capability})", flush=True)
        env = {**os.environ, _ENV: capability}
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              *SENSITIVE], env=env)
        worst = worst or rc
    return worst


if __name__ == "__main__":
    sys.exit(main())
