"""`python -m raytrain.plan`: the first round's name of `python -m raytrain.tools.plan`, which it runs.

The tools moved to raytrain/tools in the second round (issue 13); users' notes, scripts and issue 14's targets still
say the old name, so it stays an alias rather than a "No module named" error. Importing it costs the tool's imports.
"""

import sys

from raytrain.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
