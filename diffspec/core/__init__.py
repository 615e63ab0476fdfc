"""The engine-free core: one implementation of every rule, shared by the reference
decoder and by both engine adapters.

Design notes: docs/design/core.md (section ``diffspec/core/__init__.py``).
"""

PLACEHOLDER_TOKEN_ID = -1
