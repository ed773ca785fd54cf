"""Calls gradsync.init() and reports the outcome: ``initialised rank R of N`` or the error.

Exits with status 3 when init() raises GradsyncError, so a test can tell the library's own,
clear error from a crash.
"""

import sys

import gradsync

try:
    gradsync.init()
except gradsync.GradsyncError as exc:
    print(f"GradsyncError: {exc}", flush=True)
    sys.exit(3)
print(f"initialised rank {gradsync.rank()} of {gradsync.size()}", flush=True)
gradsync.shutdown()
