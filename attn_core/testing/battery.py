"""The conformance battery: collected by the kit's plugin, parametrised by the capability matrix.

Not a project test module: it runs only under ``pytest --attn-backend=vendor:name``.
"""

from __future__ import annotations

import zlib

import pytest

from attn_core.testing.checks import BackendRaised, ConformanceFailure, ReferenceRaised
from attn_core.testing.matrix import CHECKS, Case, build_matrix
from attn_core.testing.plugin import SESSION_KEY
from attn_core.testing.scenarios import _Skip, run_case


def _session(config: pytest.Config):
    if SESSION_KEY not in config.stash:
        pytest.skip("the conformance battery runs only with --attn-backend=vendor:name")
    return config.stash[SESSION_KEY]


_MATRIX_KEY = pytest.StashKey[list]()


def _matrix(config: pytest.Config) -> list[Case]:
    if _MATRIX_KEY not in config.stash:
        s = config.stash[SESSION_KEY]
        config.stash[_MATRIX_KEY] = build_matrix(
            s.backend.capabilities,
            quick=s.quick,
            device=s.device,
            device_caps=s.device_caps,
            has_cuda=s.has_cuda,
        )
    return config.stash[_MATRIX_KEY]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames or SESSION_KEY not in metafunc.config.stash:
        return
    check = next(k for k, name in CHECKS.items() if name == metafunc.function.__name__)
    cases = [c for c in _matrix(metafunc.config) if c.check == check]
    if cases:
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])
    else:
        metafunc.parametrize(
            "case",
            [
                pytest.param(
                    None,
                    marks=pytest.mark.skip(
                        reason=f"the backend advertises nothing this check ({check}) applies to"
                    ),
                )
            ],
        )


def _run(case: Case, config: pytest.Config) -> None:
    session = _session(config)
    if session.skip_reason:
        pytest.skip(session.skip_reason)
    if case.skip:
        pytest.skip(case.skip)
    seed = (session.seed + zlib.crc32(f"{case.check}:{case.id}".encode())) % 2**31
    failure = skip = None
    try:
        run_case(case, session, seed)
    except (ReferenceRaised, _Skip) as exc:
        skip = str(exc)
    except (ConformanceFailure, BackendRaised) as exc:
        failure = exc
    # Outside the except blocks: the report shows the kit's message, not a chained traceback.
    if skip is not None:
        pytest.skip(skip)
    if failure is not None:
        claims = "; ".join(case.capabilities)
        pytest.fail(
            f"{session.backend_name} advertised [{claims}], failed: {failure}\n"
            f"  case {case.check}:{case.id}, item seed {seed}, rerun with "
            f"--attn-seed={session.seed}",
            pytrace=False,
        )


def test_correctness(case: Case, pytestconfig: pytest.Config) -> None:
    """A named workload on one advertised configuration equals the reference."""
    _run(case, pytestconfig)


def test_lifecycle(case: Case, pytestconfig: pytest.Config) -> None:
    """One allocation, many steps with requests joining and leaving."""
    _run(case, pytestconfig)


def test_update_refreshes_metadata(case: Case, pytestconfig: pytest.Config) -> None:
    """prepare() once, then update() only: every later batch is computed, not the first."""
    _run(case, pytestconfig)


def test_cuda_graph_replay(case: Case, pytestconfig: pytest.Config) -> None:
    """Capture after prepare(), replay after update() with changed metadata."""
    _run(case, pytestconfig)


def test_out_contract(case: Case, pytestconfig: pytest.Config) -> None:
    """out given, strided out, out=None; no write outside out; inputs untouched."""
    _run(case, pytestconfig)


def test_state(case: Case, pytestconfig: pytest.Config) -> None:
    """Chunked prefill == one prefill; prefix-cache restore continues exactly."""
    _run(case, pytestconfig)
