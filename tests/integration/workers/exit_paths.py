"""Ends without closing a file or flushing C stdio, and says whether it was forked from a preload."""

import ctypes
import faulthandler
import sys

PRELOADED = "torch" in sys.modules

import torch  # noqa: E402,F401

print(f"preloaded={PRELOADED} faulthandler={faulthandler.is_enabled()} orig_argv={sys.orig_argv[-2:]}", flush=True)
unclosed = open("unclosed.txt", "w")  # noqa: SIM115 - left open on purpose: the interpreter's end closes it
unclosed.write("every byte arrives\n")
ctypes.CDLL(None).printf(b"a C printf line\n")
