"""CLI command groups; each module defines ``register(app)``."""
