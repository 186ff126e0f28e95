"""Optional integrations of kvcompose with serving engines.

Each subpackage imports its engine lazily, so `import kvcompose` never needs one. See `docs/serving.md`.
"""
