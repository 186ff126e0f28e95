"""`python -m kvcompose.bench.external NAME`: print the path of a shipped external script."""

import sys

from ...view import KVComposeError
from . import SCRIPTS, script

if len(sys.argv) != 2:
    print(f"usage: python -m kvcompose.bench.external {{{','.join(SCRIPTS)}}}", file=sys.stderr)
    sys.exit(2)
try:
    print(script(sys.argv[1]))
except KVComposeError as e:
    print(f"kvcompose: error: {e}", file=sys.stderr)
    sys.exit(2)
