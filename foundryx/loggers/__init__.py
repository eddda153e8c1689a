"""Built-in logger destinations (registered through entry points in pyproject.toml)."""
