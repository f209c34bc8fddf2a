"""Root conftest: pytest plugins must be declared at the top level (pytest >= 8)."""

pytest_plugins = ["pytester"]
