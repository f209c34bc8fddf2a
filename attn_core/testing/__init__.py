"""The attn-core conformance kit: a pytest plugin that checks a backend against the reference.

With attn-core and a vendor's plugin installed::

    pytest --attn-backend=vendor:name            # the whole battery, nothing else
    pytest --attn-backend=vendor:name --attn-quick

The plugin (:mod:`attn_core.testing.plugin`, entry point ``pytest11``) is loaded by every pytest
run but does nothing unless ``--attn-backend`` (or ``ATTN_CORE_CONFORMANCE_BACKEND``) is given.
Modules:

- :mod:`~attn_core.testing.plugin`: options, collection of the battery, the final report.
- :mod:`~attn_core.testing.session`: registry, backend under test, device, seed.
- :mod:`~attn_core.testing.matrix`: the capability matrix derived from ``Backend.capabilities``.
- :mod:`~attn_core.testing.workloads`: named step sequences and random inputs.
- :mod:`~attn_core.testing.harness`: a backend and the reference driven side by side.
- :mod:`~attn_core.testing.checks`: tolerances and the checks themselves.
- :mod:`~attn_core.testing.report`: per-capability outcomes (no torch).
- :mod:`~attn_core.testing.battery`: the test module the plugin collects.

Nothing is imported here: ``import attn_core.testing`` must stay cheap for every pytest run.
"""

from __future__ import annotations
