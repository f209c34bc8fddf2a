"""Helpers for tests of transformers configs: skip markers naming the release that brought a
config class, the check that the config mapping refuses a config, and the sizes of a small
decoder config.

attn-core supports transformers from :data:`attn_core.e2e.hf_version.TRANSFORMERS_FLOOR` on;
a test of a config class or modeling code that came in a later release skips on an older one,
saying which (and runs wherever that release or a newer one is installed)::

    pytest.param("exaone", ..., marks=since_transformers("5.24.0", "ExaoneConfig ('exaone')"))

Not imported by :mod:`attn_core.testing`; the test modules import it.
"""

from __future__ import annotations

from typing import Any

import pytest

from attn_core.e2e.hf_version import installed_transformers, parse_version
from attn_core.models import specs_from_hf_config

__all__ = ["mapping_refuses", "since_transformers", "small_decoder", "transformers_before"]


def transformers_before(version: str) -> bool:
    """Whether the installed transformers is older than ``version`` (False where it is not
    installed: the test module's own ``importorskip`` says so)."""
    have = installed_transformers()
    return have is not None and parse_version(have) < parse_version(version)


def since_transformers(version: str, what: str) -> pytest.MarkDecorator:
    """Skip where the installed transformers is older than ``version``, the first release with
    ``what`` (a config class, a modeling module's behaviour)."""
    return pytest.mark.skipif(
        transformers_before(version),
        reason=f"{what}: transformers {version} or newer; this is {installed_transformers()}",
    )


def mapping_refuses(config: dict[str, Any], *fragments: str) -> str:
    """Assert that ``specs_from_hf_config(config)`` raises a ValueError whose message holds
    every one of ``fragments``; returns the message."""
    with pytest.raises(ValueError) as err:
        specs_from_hf_config(config)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def small_decoder(num_hidden_layers: int) -> dict[str, Any]:
    """A decoder config's sizes, small enough to build any transformers config class on the
    CPU: ``num_hidden_layers`` layers, hidden size 64, 4 query heads over 2 KV heads (head dim
    16), vocabulary 128, no special token ids. Test cases add the fields that tell a family
    apart."""
    return {
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
