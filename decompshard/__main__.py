import atexit
import os
import sys

from decompshard.cli import main

code = main()
if code == 130:
    # Ctrl-C, already handled (one line printed). CPython 3.11 still ends a `python -m`
    # run by re-raising SIGINT (exit -2) when a KeyboardInterrupt ever went through code
    # run by exec() of a string (dataclasses does it while torch imports), even a caught
    # one; leave with the code we chose instead, after the usual exit handlers.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
