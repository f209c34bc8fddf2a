"""The transformers release ``attn run`` needs, and the installed one.

``attn run`` builds each model with transformers and compares with its forward, so what it can
run follows the release: config classes, their defaults and modeling code change between 5.x
releases. :data:`TRANSFORMERS_FLOOR` is the oldest release the tests pass on (pyproject's
``run`` extra declares the same); :func:`require_transformers` refuses an older one,
naming both versions (``attn run`` prints it as its error).
"""

from __future__ import annotations

import re
from importlib import metadata

from attn_core.errors import AttnCoreError

__all__ = [
    "TRANSFORMERS_FLOOR",
    "installed_transformers",
    "parse_version",
    "require_transformers",
]

#: The oldest transformers release ``attn run`` supports (``attn-core[run]`` requires it).
TRANSFORMERS_FLOOR = "5.17.0"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"5.18.0"`` -> ``(5, 18, 0)``; a suffix (``rc1``, ``.dev0``, ``+local``) is dropped."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"{text!r} is not a version number")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_transformers() -> str | None:
    """The installed transformers' version string; None where it is not installed."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def require_transformers() -> str:
    """The installed transformers' version, if it is :data:`TRANSFORMERS_FLOOR` or newer.

    :raises AttnCoreError: transformers is missing or older, naming both versions.
    """
    have = installed_transformers()
    need = f"transformers>={TRANSFORMERS_FLOOR}"
    if have is None:
        raise AttnCoreError(
            f"`attn run` needs {need} (pip install 'attn-core[run]'); transformers is not installed"
        )
    if parse_version(have) < parse_version(TRANSFORMERS_FLOOR):
        raise AttnCoreError(
            f"`attn run` needs {need}: this environment has transformers {have}, whose config "
            f"classes and modeling code differ from the ones attn-core is tested against "
            f"(pip install '{need}')"
        )
    return have
