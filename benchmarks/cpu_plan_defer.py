"""``vramguard plan`` with (``on``) or without (``off``) the deferred import-time ``torch.compile`` calls of
bitsandbytes and hqq (:func:`vramguard.extras.defer_import_time_compiles`, installed by ``import vramguard``; ``off``
removes its finder before the command runs). The rest of the command line is ``plan``'s.

    VRAMGUARD_PLAN_CACHE=$(mktemp -d) VRAMGUARD_TAPE_CACHE=$(mktemp -d) /usr/bin/time \
        python benchmarks/cpu_plan_defer.py off FOLDER --format json
"""

import sys

import vramguard  # noqa: F401 -- installs the finder
from vramguard.cli import main

if __name__ == "__main__":
    if sys.argv[1] == "off":
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_DeferredCompileFinder"]
    sys.argv = ["vramguard", "plan", *sys.argv[2:]]
    main()
