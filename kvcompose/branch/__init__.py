"""Branch-aware KV cache for tree search (ArborKV-style): `BranchCache` on kvcompose's one layer core.

- `tree`: the nodes, `BranchLayer` (the active path of one decoder layer) and `BranchMemory`.
- `cache`: `BranchCache` (fork, switch, drop, prune, compress, rehydrate).
"""

from .cache import BranchCache
from .tree import BranchLayer, BranchMemory

__all__ = ["BranchCache", "BranchLayer", "BranchMemory"]
